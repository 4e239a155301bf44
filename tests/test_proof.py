"""A checkpoint's proof of itself (trainer/checkpoint/proof.py, state_hash.py, chain.py): the state hash is the
same whoever holds which element and changes with any element; the sample ledger is the same at any world size
and changes with a sample read twice; a resume refuses a state that does not hash to its record; ``ckpt verify``
says in one line what holds."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import BIN, ROOT, cli_env
from trainpipe.trainer.checkpoint import catalog
from trainpipe.trainer.checkpoint.chain import verify_run
from trainpipe.trainer.checkpoint.proof import Sum
from trainpipe.trainer.checkpoint.state_hash import ledger_sum, planned_ledger, rng_digest, state_sum, tensor_sum
from trainpipe.trainer.checkpoint.storage import HashingWriter
from trainpipe.trainer.data.sampler import DataSkip, data_index, rank_samples
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.loop.rng import rng_state, set_rng_state
from trainpipe.trainer.store_paths import CHECKPOINT_MANIFEST, RunPaths
from trainpipe.trainer.supervise.attempt import train_attempt

pytestmark = pytest.mark.usefixtures("warm_module")


def test_a_tensor_hashes_the_same_in_any_blocks_and_differently_after_any_change():
    t = torch.randn(7, 5, 3)
    whole = tensor_sum("w", t, (7, 5, 3), (0, 0, 0))
    rows = tensor_sum("w", t[:3], (7, 5, 3), (0, 0, 0)) + tensor_sum("w", t[3:], (7, 5, 3), (3, 0, 0))
    columns = tensor_sum("w", t[:, :2], (7, 5, 3), (0, 0, 0)) + tensor_sum("w", t[:, 2:], (7, 5, 3), (0, 2, 0))
    assert whole == rows == columns  # FSDP's row shards, a tensor-parallel column split
    ulp = t.clone()
    ulp[1, 1, 1] = torch.nextafter(ulp[1, 1, 1], torch.tensor(float("inf")))
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    others = [
        tensor_sum("w", ulp, (7, 5, 3), (0, 0, 0)),  # one bit of one element
        tensor_sum("w", swapped, (7, 5, 3), (0, 0, 0)),  # the same values elsewhere
        tensor_sum("v", t, (7, 5, 3), (0, 0, 0)),  # another tensor's name
        tensor_sum("w", t.double(), (7, 5, 3), (0, 0, 0)),  # another dtype
        tensor_sum("w", t.reshape(35, 3), (35, 3), (0, 0)),  # another shape
    ]
    assert len({whole, *others}) == 6


def test_a_tensors_hash_is_the_one_stored_checkpoints_recorded():
    """The hash is a format: checkpoints in stores carry it in their proofs, so a faster way of computing it must
    give the same values (pinned from the first implementation), for every kind of element and a wide tensor."""
    base = torch.randn(3000, generator=torch.Generator().manual_seed(0)) * 1e3
    cases = {
        "f32": base,
        "bf16": base.bfloat16(),
        "f64": base.double(),
        "i64": base.long() * (1 << 40),
        "bool": base > 0,
        "c64": torch.complex(base, -base),
    }
    got = {name: tensor_sum(name, v, (3000,), chunk=1024).hex() for name, v in cases.items()}
    got["wide"] = tensor_sum("wide", base[:10].reshape(5, 2), (1 << 31, 2), offset=((1 << 30) + 5, 0)).hex()
    assert got == {
        "f32": "000002ff38b92fea000002ea3f58a1b1",
        "bf16": "000002f3271e9382000002f611c2a4f3",
        "f64": "000002f2d0353ae5000002edb117dee4",
        "i64": "000002e7b289049c000002f23959b995",
        "bool": "000002fe4eab89a100000300d394deae",
        "c64": "000005c08dbd5966000005d7e58a9a57",
        "wide": "0000000279f4c72b0000000212a89bc7",
    }


def test_a_state_hash_shares_a_replicated_tensor_out_by_rows_and_counts_every_plain_value():
    """DDP: every rank holds the same tensors; each adds its share of the rows (so every copy is read), and the
    plain values are rank 0's. Three ranks of a four-row tensor: the third holds none."""
    state = {"model": {"w": torch.randn(4, 3), "b": torch.randn(4), "s": torch.tensor(2.0)}, "sched": {"last": 3}}
    alone = state_sum(state, 0, 1)
    for world in (2, 3, 4):
        assert sum((state_sum(state, r, world) for r in range(world)), Sum()) == alone
    assert alone != state_sum({**state, "sched": {"last": 4}}, 0, 1)
    assert Sum.parse(alone.hex()) == alone


def test_a_complex_tensor_hashes_its_parts_in_any_blocks():
    z = torch.randn(6, 2, dtype=torch.complex64)
    whole = tensor_sum("z", z, (6, 2), (0, 0))
    assert whole == tensor_sum("z", z[:4], (6, 2), (0, 0)) + tensor_sum("z", z[4:], (6, 2), (4, 0))
    assert whole != tensor_sum("z", torch.view_as_complex(torch.view_as_real(z).flip(-1).contiguous()), (6, 2), (0, 0))


def test_the_rng_hash_covers_the_ranks_own_cuda_stream_only():
    python, own, other = (
        random.getstate(),
        torch.tensor([1, 2], dtype=torch.uint8),
        torch.tensor([3], dtype=torch.uint8),
    )
    four = {"python": python, "torch": own, "cuda": [own, other, other, other]}
    one = {"python": python, "torch": own, "cuda": [own]}
    assert rng_digest(four, 0) == rng_digest(one, 0) != rng_digest({**four, "cuda": [other, own]}, 0)


def test_the_rng_hash_of_a_seeded_state_is_the_one_earlier_versions_recorded():
    """Checkpoints keep the RNG hash their version computed: a faster way to compute it must give the same one
    (this value is the version before the hash joined its parts)."""
    before = rng_state()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    try:
        assert rng_digest(rng_state()) == "4c7534b59afc0555d02bc76e97b4fc9b4ad1e6d878d2b27969abe88ecaf2e1a2"
    finally:
        set_rng_state(before)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_ledger_of_the_ranks_is_the_planned_one_at_any_world_size(world_size):
    """Each rank adds the samples it read; their sum is the plan whatever the world size. A sample read twice in
    place of another is a different ledger."""
    batch, seed, n, steps = 8, 3, 20, 7  # 56 samples: the order crosses into epoch 2
    skips = [DataSkip(after_step=2, steps=2, spike_step=4)]
    total, swapped = Sum(), Sum()
    for step in range(1, steps + 1):
        position = data_index(step, skips)
        for rank in range(world_size):
            ids = rank_samples(position, batch, seed, n, rank, world_size)
            first = position * batch + rank * len(ids)
            total = total + ledger_sum(np.arange(first, first + len(ids)), ids, n)
            if step == 5 and rank == 0:
                ids = ids.copy()
                ids[1] = ids[0]
            swapped = swapped + ledger_sum(np.arange(first, first + len(ids)), ids, n)
    assert total == planned_ledger(1, steps, skips, batch, seed, n)
    assert total == planned_ledger(1, 3, skips, batch, seed, n) + planned_ledger(4, steps, skips, batch, seed, n)
    assert swapped != total and total != planned_ledger(1, steps, [], batch, seed, n)


def test_a_manifest_whose_proof_is_not_one_is_an_invalid_checkpoint():
    good = {"state": "0" * 32, "rng": ["a" * 64], "ledger": None, "samples": 0}
    assert catalog.proof_problem(good, 1) is None
    assert "RNG hashes for world size 2" in catalog.proof_problem(good, 2)
    for bad in (
        {**good, "state": "../x"},
        {**good, "extra": 1},
        {**good, "rng": "a" * 64},
        [],
        {**good, "samples": -1},
    ):
        assert catalog.proof_problem(bad, 1).startswith("manifest field proof is not a proof"), bad


def _resave(checkpoint: Path, change) -> None:
    """Rewrite a checkpoint's tensors through DCP with ``change`` applied to its state, and fix up every file's
    sha256 and size in its manifest, leaving its proof as it was: files that hash right and hold another state."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    state = _load_state_dict_from_keys(checkpoint_id=str(checkpoint))
    change(state)
    for f in checkpoint.glob("*.distcp"):
        f.unlink()
    (checkpoint / ".metadata").unlink()
    dcp.save(state, storage_writer=HashingWriter(str(checkpoint)), no_dist=True)  # as the ranks write
    manifest = json.loads((checkpoint / CHECKPOINT_MANIFEST).read_text())
    files = [p for p in checkpoint.rglob("*") if p.is_file() and p.name != CHECKPOINT_MANIFEST]
    rel = {str(p.relative_to(checkpoint)): p for p in files}
    manifest["files"] = {r: hashlib.sha256(p.read_bytes()).hexdigest() for r, p in sorted(rel.items())}
    manifest["sizes"] = {r: p.stat().st_size for r, p in sorted(rel.items())}
    (checkpoint / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest))


def _nudge(state) -> None:
    """One optimizer moment one ulp up."""
    moments = next(v for v in state["optim"]["state"].values() if "exp_avg" in v)
    flat = moments["exp_avg"].view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))


def test_a_resume_refuses_a_state_that_does_not_hash_to_its_record(tiny_profile):
    """The same state written again loads verified; one optimizer moment changed, with the manifest's file hashes
    fixed up to match, is refused by the state hash like a corrupt file, and the run resumes from the one before."""
    prof = tiny_profile("cluster.procs_per_node=1", "checkpoint.every_steps=4", "tracking.enabled=false")
    uri = shard_dataset(prof.data, prof.store).uri
    assert train_attempt(prof, "tamper", uri).result.final_step == 8
    step8 = Path(RunPaths(prof.store.root, "tamper").checkpoint(8))

    _resave(step8, lambda state: None)
    second = train_attempt(prof, "tamper", uri, attempt=2)
    same = second.result
    assert same is not None, second.job.tail[-30:]
    assert (same.start_step, same.resume_verified, same.skipped_checkpoints) == (8, True, [])

    _resave(step8, _nudge)
    assert catalog.inspect_checkpoint(str(step8)).valid  # every file matches its manifest
    again = train_attempt(prof, "tamper", uri, attempt=3).result
    assert again.start_step == 4 and again.resume_verified is True, again
    [refused] = again.skipped_checkpoints
    assert refused.uri == str(step8) and "hashes to" in refused.reason and "recorded at its save" in refused.reason


def test_ckpt_verify_says_in_one_line_what_holds_and_what_does_not(tiny_profile, home):
    import subprocess

    prof = tiny_profile("checkpoint.every_steps=4", "tracking.enabled=false")
    uri = shard_dataset(prof.data, prof.store).uri
    assert train_attempt(prof, "proved", uri).result.final_step == 8

    def verify(*extra: str) -> tuple[int, str, str]:
        proc = subprocess.run(
            [str(BIN / "trainpipe"), "ckpt", "verify", "proved", *extra],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=cli_env({"TRAINPIPE_HOME": str(home)}),
            timeout=120,
        )
        return proc.returncode, proc.stdout.strip(), proc.stderr.strip()

    code, out, _ = verify()
    assert code == 0 and out.startswith("run proved: 2 checkpoint(s) hold (steps 4-8)"), out
    assert "the ledger of step 8 is the sample order's 64 samples" in out and "each sample of an epoch once" in out
    step8 = Path(RunPaths(prof.store.root, "proved").checkpoint(8))
    manifest = json.loads((step8 / CHECKPOINT_MANIFEST).read_text())
    forged = {**manifest, "proof": {**manifest["proof"], "ledger": "1" * 32}}
    (step8 / CHECKPOINT_MANIFEST).write_text(json.dumps(forged))
    code, out, _ = verify()
    assert code == 1 and out == (
        "run proved: checkpoint at step 8 fails: its ledger is not the sample order's: some sample was consumed "
        "twice, or another in its place (1 of 2 fail)"
    ), out
    elsewhere = {**manifest, "dataset_uri": str(Path(prof.store.root).parent / "datasets" / "x")}
    (step8 / CHECKPOINT_MANIFEST).write_text(json.dumps(elsewhere))
    code, out, err = verify("--json")  # the text on stderr, the JSON alone on stdout
    assert code == 1 and "is not one of this store's datasets" in err.splitlines()[0], err
    assert json.loads(out)["holds"] is False
    shutil.rmtree(step8.parent)
    store = prof.store
    report = verify_run("proved", str(step8.parent), store.root, store.storage_options, [])
    assert not report.holds and report.line() == "run proved: no checkpoints to verify"


def test_every_checkpoint_refused_by_its_state_hash_stops_the_run_instead_of_starting_over(tiny_profile):
    """Both checkpoints rewritten with a changed moment: no silent restart from step 0, but one line saying what
    to do; with checkpoint.verify_state=false the newest resumes, unverified."""
    prof = tiny_profile("cluster.procs_per_node=1", "checkpoint.every_steps=4", "tracking.enabled=false")
    uri = shard_dataset(prof.data, prof.store).uri
    assert train_attempt(prof, "refused", uri).result.final_step == 8
    for step in (4, 8):
        _resave(Path(RunPaths(prof.store.root, "refused").checkpoint(step)), _nudge)
    stopped = train_attempt(prof, "refused", uri, attempt=2)
    assert stopped.result is None and stopped.incident.kind != "crash", stopped.incident
    line = stopped.incident.line()
    assert "no checkpoint of run refused loads: 2 refused by their state hash" in line, line
    assert "--set checkpoint.verify_state=false" in line
    lenient = tiny_profile(
        "cluster.procs_per_node=1",
        "checkpoint.every_steps=4",
        "tracking.enabled=false",
        "checkpoint.verify_state=false",
    )
    unverified = train_attempt(lenient, "refused", uri, attempt=3).result
    assert (unverified.start_step, unverified.resume_verified) == (8, False)


def test_a_forged_ledger_count_leaves_the_ledger_unknown_and_training_going(tiny_profile, home):
    """The state hash does not cover the ledger's count: a count that is not the steps' own is not carried on
    (it used to overflow the next commit's proof), and ``ckpt verify`` says the ledger is unknown."""
    prof = tiny_profile("cluster.procs_per_node=1", "checkpoint.every_steps=4", "tracking.enabled=false")
    uri = shard_dataset(prof.data, prof.store).uri
    assert train_attempt(prof, "counted", uri).result.final_step == 8
    step8 = Path(RunPaths(prof.store.root, "counted").checkpoint(8))
    manifest = json.loads((step8 / CHECKPOINT_MANIFEST).read_text())
    manifest["proof"]["samples"] = 2**62
    (step8 / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest))
    longer = tiny_profile(
        "cluster.procs_per_node=1", "checkpoint.every_steps=4", "tracking.enabled=false", "train.steps=12"
    )
    done = train_attempt(longer, "counted", uri, attempt=2)
    assert done.result is not None and done.result.final_step == 12, done.job.tail[-20:]
    assert done.result.resume_verified is True
    step12 = catalog.inspect_checkpoint(RunPaths(prof.store.root, "counted").checkpoint(12))
    assert step12.manifest["proof"]["ledger"] is None and step12.manifest["proof"]["samples"] == 0


def test_ckpt_verify_names_a_hostile_manifest_in_its_line_and_goes_on(tiny_profile):
    prof = tiny_profile("checkpoint.every_steps=4", "tracking.enabled=false", "cluster.procs_per_node=1")
    uri = shard_dataset(prof.data, prof.store).uri
    assert train_attempt(prof, "hostile", uri).result.final_step == 8
    run = RunPaths(prof.store.root, "hostile")
    step4 = Path(run.checkpoint(4)) / CHECKPOINT_MANIFEST
    good = json.loads(step4.read_text())
    store = prof.store
    hostile = [
        ({**good, "profile": {**good["profile"], "train": ["x"]}}, "has no train or model section"),
        ({**good, "data_position": {**good["data_position"], "skips": 5}}, "not a list of at most 64"),
        ({**good, "data_position": {**good["data_position"], "next_step": "9" * 10_000}}, "…, not 4"),
        ({**good, "dataset_uri": good["dataset_uri"] + "-gone"}, "cannot be checked"),
        ({**good, "profile": {**good["profile"], "train": {"global_batch": 1 << 30}}}, "global_batch"),
    ]
    for body, says in hostile:
        step4.write_text(json.dumps(body))
        report = verify_run("hostile", run.checkpoints, store.root, store.storage_options, [])
        line = report.line()
        assert not report.holds and says in line and len(line) < 400, line
        assert report.checked[1].problem == "", report.as_dict()  # step 8 is still checked


def test_a_gpt_checkpoint_from_before_q_k_v_were_apart_is_one_line_saying_so(tiny_profile):
    """The built-in GPT's attention once held one fused qkv matrix; tensor parallelism needs q, k and v apart.
    A checkpoint of the fused kind does not load into today's model: the run stops with one line that says why
    and what to do, instead of starting over."""
    prof = tiny_profile("cluster.procs_per_node=1", "checkpoint.every_steps=4", "tracking.enabled=false")
    uri = shard_dataset(prof.data, prof.store).uri
    assert train_attempt(prof, "fused", uri).result.final_step == 8
    for step in (4, 8):

        def fuse(state) -> None:
            model = state["model"]
            for q in [k for k in model if k.endswith(".attn.q.weight") or k.endswith(".attn.q.bias")]:
                parts = [model.pop(q.replace(".attn.q.", f".attn.{p}.")) for p in "qkv"]
                model[q.replace(".attn.q.", ".attn.qkv.")] = torch.cat(parts)

        _resave(Path(RunPaths(prof.store.root, "fused").checkpoint(step)), fuse)
    resumed = train_attempt(prof, "fused", uri, attempt=2)
    assert resumed.result is None and resumed.incident.kind == "error", resumed.incident
    line = resumed.incident.detail
    assert "before the built-in GPT kept q, k and v apart" in line and "start a new run" in line and "\n" not in line
