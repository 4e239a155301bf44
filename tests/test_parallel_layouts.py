"""``parallel`` layouts: tensor, pipeline and data parallelism over one DeviceMesh (4 real torchrun ranks, gloo).

Each layout trains and its loss falls to the plain FSDP2 run's within the numerics of another reduction order; a
SIGKILL in a 2-D layout resumes to the uninterrupted digest, its resume verified; a checkpoint of one layout
resumes in another (tp 2 × dp 2 to dp 4, pp 2 × dp 2 to none) to the same val loss within that tolerance, its state
hash verified across layouts; a whole-model checkpoint resumes in two pipeline stages. Bad layouts are one line
before anything starts.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.conftest import TINY
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import RunPaths

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("warm_module")]

FOUR = [
    *TINY,
    "tracking.enabled=false",
    "train.strategy=fsdp",
    "model.n_layer=2",
    "cluster.procs_per_node=4",
    "checkpoint.async=false",  # step 4 is committed before the kill at step 6, whatever the timing
    "watchdog.straggler_window=3",
]
KILL = ["faults.kind=crash", "faults.step=6", "faults.rank=1", "faults.attempts=1"]  # SIGKILLs itself
LAYOUTS = {
    "dp_shard 2 × tp 2": ["parallel.tp=2"],
    "pp 2 × dp_shard 2 (1f1b)": ["parallel.pp=2"],
    "pp 2 × tp 2 (gpipe)": ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=gpipe"],
    "dp_replicate 2 × dp_shard 2 (HSDP)": ["parallel.dp_replicate=2"],
    "dp_replicate 2 × tp 2 (HSDP of shard 1)": ["parallel.dp_replicate=2", "parallel.tp=2"],
    "pp 4 (middle stages, 1f1b)": ["parallel.pp=4", "model.n_layer=4"],
}
# A layout's plain run, when its model is not the others': 4 layers for 4 stages.
REFERENCE = {"pp 4 (middle stages, 1f1b)": ("plain-4-layers", ["model.n_layer=4"])}
# Another layout sums in another order: 8 steps of this model land within this of each other's val loss (the
# spread observed over these layouts is 5e-7).
TOLERANCE = 2e-5
UNTRAINED = math.log(256)  # a byte model's loss before it learns anything


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Attempts by (run name, layout's settings), each trained once for the module, on one dataset."""
    import os

    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.supervise.attempt import train_attempt

    home = tmp_path_factory.mktemp("layouts")
    before = os.environ.get("TRAINPIPE_HOME")
    os.environ["TRAINPIPE_HOME"] = str(home)
    profile = load_profile("local", FOUR)
    dataset = shard_dataset(profile.data, profile.store).uri
    done: dict[tuple[str, tuple[str, ...], int], object] = {}

    def run(name: str, settings: list[str], attempt: int = 1):
        key = (name, tuple(settings), attempt)
        if key not in done:
            done[key] = train_attempt(load_profile("local", [*FOUR, *settings]), name, dataset, attempt=attempt)
        return done[key]

    def fork(source: str, copy: str) -> None:
        """Run ``copy``: ``source``'s folder as it is now (once), to resume under another layout."""
        if copy not in done:
            shutil.copytree(RunPaths(profile.store.root, source).dir, RunPaths(profile.store.root, copy).dir)
            done[copy] = True

    run.fork, run.root = fork, profile.store.root
    yield run
    if before is None:
        os.environ.pop("TRAINPIPE_HOME", None)
    else:
        os.environ["TRAINPIPE_HOME"] = before


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_trains_and_its_loss_falls_to_the_plain_runs(runs, layout):
    plain = runs(*REFERENCE.get(layout, ("plain", [])))
    split = runs(_run_name(layout), LAYOUTS[layout])
    assert plain.result is not None and split.result is not None, "\n".join(split.job.tail[-30:])
    assert split.result.final_step == 8
    assert split.result.val_loss < UNTRAINED - 0.5, split.result.val_loss
    assert abs(split.result.val_loss - plain.result.val_loss) < TOLERANCE, (
        split.result.val_loss,
        plain.result.val_loss,
    )
    mesh = load_profile("local", [*FOUR, *LAYOUTS[layout]]).layout  # each rank beaconed its place as it built it
    assert {r: p.get("m") for r, p in split.progress.items()} == {r: mesh.place(r) for r in range(4)}
    # each rank holds a part: under 0.6 of the whole weights and optimizer state (FSDP2's ranks' sum)
    assert len(split.result.state_mb) == 4 and max(split.result.state_mb) < 0.6 * sum(plain.result.state_mb)


def _run_name(layout: str) -> str:
    shared = {"dp_shard 2 × tp 2": "tp-ref", "pp 2 × dp_shard 2 (1f1b)": "pp-ref"}  # the references below
    name = shared.get(layout) or layout.replace(" ", "").replace("×", "x").replace("(", "-").replace(")", "")
    return name.replace(",", "")


@pytest.mark.parametrize("layout", ["plain FSDP2 over 4", *LAYOUTS])
def test_each_layouts_checkpoint_exports_to_stock_transformers_with_its_logits(runs, layout, tmp_path):
    """``trainpipe models export`` of the layout's final checkpoint: GPT-2 in transformers, trainpipe's logits, and
    the state hash recomputed from the stored records."""
    from tests.hf_check import exported_logits_match
    from trainpipe.trainer.export.folder import export_checkpoint

    name, settings = ("plain", []) if layout not in LAYOUTS else (_run_name(layout), LAYOUTS[layout])
    done = runs(name, settings)
    profile = load_profile("local", [*FOUR, *settings])
    report = export_checkpoint(done.result.checkpoint_uri, tmp_path / "model", profile, check_state=True)
    assert report.model_type == "gpt2" and report.model_digest == done.result.model_digest
    # every record of every rank's file, summed in one process, is the state hash the ranks recorded
    manifest = json.loads((Path(done.result.checkpoint_uri) / "trainpipe.json").read_text())
    assert report.state_hash == manifest["proof"]["state"]
    exported_logits_match(done.result.checkpoint_uri, tmp_path / "model", profile)


def test_a_sigkill_in_a_2d_layout_resumes_to_the_uninterrupted_digest(runs):
    reference = runs("tp-ref", ["parallel.tp=2"])
    killed = runs("tp-killed", ["parallel.tp=2", *KILL])
    assert killed.result is None and killed.incident.kind == "crash" and killed.incident.rank == 1
    runs.fork("tp-killed", "tp-to-dp4")  # for the cross-layout test below
    resumed = runs("tp-killed", ["parallel.tp=2", *KILL], attempt=2)
    assert resumed.result is not None, "\n".join(resumed.job.tail[-30:])
    assert resumed.result.start_step == 4 and resumed.result.final_step == 8
    assert resumed.result.resume_verified is True
    assert resumed.result.model_digest == reference.result.model_digest


def test_a_checkpoint_resumes_in_another_layout_to_the_same_val_loss(runs):
    """dp_shard 2 × tp 2 → DDP over 4 (its step-4 checkpoint, from the killed run above); pp 2 × dp_shard 2 (a
    head tied to the embedding across the stages) → FSDP2 over 4; FSDP2 over 4 → pp 2 × dp_shard 2."""
    reference = runs("tp-ref", ["parallel.tp=2"])
    runs("tp-killed", ["parallel.tp=2", *KILL])
    runs.fork("tp-killed", "tp-to-dp4")
    to_dp4 = runs("tp-to-dp4", ["train.strategy=ddp"], attempt=2)
    assert to_dp4.result is not None, "\n".join(to_dp4.job.tail[-30:])
    assert to_dp4.result.start_step == 4 and to_dp4.result.resume_verified is True
    assert abs(to_dp4.result.val_loss - reference.result.val_loss) < TOLERANCE

    pp_reference = runs("pp-ref", ["parallel.pp=2"])
    pp_killed = runs("pp-killed", ["parallel.pp=2", *KILL])
    assert pp_killed.result is None and pp_killed.incident.kind == "crash"
    to_none = runs("pp-killed", [], attempt=2)
    assert to_none.result is not None, "\n".join(to_none.job.tail[-30:])
    assert to_none.result.start_step == 4 and to_none.result.resume_verified is True
    assert abs(to_none.result.val_loss - pp_reference.result.val_loss) < TOLERANCE

    # and back: a whole-model checkpoint (FSDP2's step 4, its optimizer state in torch's own form, the tied
    # head's under the embedding's name) into two pipeline stages, the head's copy taking the embedding's state
    plain = runs("plain", [])
    runs.fork("plain", "plain-to-pp")
    shutil.rmtree(RunPaths(runs.root, "plain-to-pp").checkpoint(8))
    to_pp = runs("plain-to-pp", ["parallel.pp=2"], attempt=2)
    assert to_pp.result is not None, "\n".join(to_pp.job.tail[-30:])
    assert to_pp.result.start_step == 4 and to_pp.result.resume_verified is True
    assert abs(to_pp.result.val_loss - plain.result.val_loss) < TOLERANCE


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        (["parallel.tp=2", "parallel.dp_shard=4"], "dp_replicate × dp_shard × tp × pp = 1 × 4 × 2 × 1 = 8, not the "
         "world size 4"),
        (["parallel.tp=3"], "parallel.tp × parallel.pp = 3 × 1 = 3 does not divide the world size 4"),
        (["parallel.tp=4", "model.n_head=2"], "parallel.tp=4 does not divide model.n_head=2"),
        (["parallel.pp=4"], "parallel.pp=4 is more than model.n_layer=2"),
        (["parallel.tp=2", "train.strategy=ddp"], "train.strategy ddp holds whole replicas only"),
        (["parallel.pp=2", "train.global_batch=6"], "train.global_batch=6 is not divisible by train.micro_batch × "
         "data-parallel ranks = 2 × 2 (pp 2 × dp_shard 2)"),
        (["parallel.pp=2", "train.global_batch=4"], "parallel.pp_schedule 1f1b needs at least as many micro-batches"),
        (["parallel.tp=2", "train.virtual_ranks=4"], "train.virtual_ranks works over one data-parallel dimension"),
        (["parallel.tp=4", "model.n_head=4", "cluster.procs_per_node=2", "cluster.nodes=2"],
         "parallel.tp=4 does not divide cluster.procs_per_node=2"),
        (["parallel.tp=2", "model.dropout=0.1"], "model.dropout=0.1 with parallel.tp=2"),
    ],
)  # fmt: skip
def test_a_bad_layout_is_one_line_before_anything_starts(home, settings, line):
    with pytest.raises(ProfileError) as caught:
        load_profile("local", [*FOUR, *settings])
    message = str(caught.value)
    assert line in message and "\n" not in message, message


def test_pp_with_a_transformers_model_whose_forward_a_stage_does_not_reproduce_is_refused(home):
    """Mistral has the same pipeline plan as Llama but a sliding window a stage would silently leave out."""
    from trainpipe.trainer.factory import check_layout

    mistral = {"model_type": "mistral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}  # fmt: skip
    profile = load_profile(
        "local",
        [*FOUR, "model.factory=trainpipe.trainer.hf:causal_lm", "parallel.pp=2"],
        {"model.config": mistral},
    )
    with pytest.raises(ProfileError, match="the transformers mistral model has no pipeline split") as caught:
        check_layout(profile.model, profile.layout)
    assert "(it splits llama)" in str(caught.value) and "\n" not in str(caught.value)


def test_tp_with_a_model_that_has_no_plan_is_refused_naming_what_to_add(home):
    from trainpipe.trainer.factory import check_layout

    profile = load_profile("local", [*FOUR, "model.factory=tests.user_model:bigram", "parallel.tp=2"])
    with pytest.raises(ProfileError, match="gives no tensor_parallel_plan") as caught:
        check_layout(profile.model, profile.layout)
    assert "\n" not in str(caught.value)
