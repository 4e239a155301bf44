"""A writer of the store attacking the readers of a checkpoint (issue 23, item 4): validate, resume, ``ckpt inspect``
and ``ckpt list`` read a checkpoint only through its manifest's own files, inside its folder, never through a
symbolic link or anything but a regular file, with the sizes the manifest states, and never import a recorded
``model.factory`` the caller did not name.

Each test is the attack as a writer of the bucket would plant it in a tiny checkpoint written in this process.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_checkpoint import CFG, _plant, _tamper, save, trained_model
from trainpipe.trainer.checkpoint.catalog import MANIFEST_MAX_BYTES, inspect_checkpoint, list_checkpoints
from trainpipe.trainer.checkpoint.loading import load_checkpoint, load_rank_extra
from trainpipe.trainer.checkpoint.storage import ChecksumMismatch
from trainpipe.trainer.checkpoint.validate import validate_checkpoint
from trainpipe.trainer.errors import CheckpointError
from trainpipe.trainer.factory import recorded_factory_problem
from trainpipe.trainer.model import GPT, model_digest
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.store_paths import CHECKPOINT_MANIFEST as MANIFEST
from trainpipe.trainer.store_paths import RunPaths, step_uri

TINY_MODEL = [f"model.{k}={getattr(CFG, k)}" for k in ("n_layer", "n_head", "n_embd", "block_size")]


@pytest.fixture
def run_ckpt(tmp_path, home):
    """(checkpoint URI, the run's paths, the trained model) of step 1 of run ``r`` in a store under ``tmp_path``."""
    paths = RunPaths(str(tmp_path / "store"), "r")
    model, optimizer = trained_model()
    return save(Path(paths.checkpoints), 1, model, optimizer), paths, model


def profile(*extra: str):
    return load_profile("local", [*TINY_MODEL, *extra])


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# ---------------------------------------------------------------- 1. a recorded model.factory


@pytest.fixture
def trap(tmp_path, monkeypatch):
    """(module name, trace file): a module on sys.path that leaves the file behind when anything imports it, as
    ``antigravity`` opens a browser and ``this`` prints."""
    folder = tmp_path / "site"
    folder.mkdir()
    trace = tmp_path / "imported"
    name = f"trap_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**8}"
    (folder / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path({str(trace)!r}).touch()\n\ndef build(cfg):\n    raise SystemExit(9)\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    return name, trace


@pytest.mark.parametrize("where", ["manifest", "profile.yaml"])
def test_a_recorded_model_factory_is_checked_before_anything_is_imported(run_ckpt, trap, where):
    uri, paths, _ = run_ckpt
    name, trace = trap
    body = profile().public()
    body["model"]["factory"] = f"{name}:build"
    if where == "manifest":
        _tamper(uri, lambda m: {**m, "profile": body})
    else:  # a checkpoint that records no profile: validate reads the run's profile.yaml
        Path(paths.profile).write_text(json.dumps(body))  # JSON is YAML
    assert inspect_checkpoint(uri).valid  # a foreign factory does not make the files invalid: only using them
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(uri, profile())
    line = one_line(exc)
    assert f"{name}:build" in line and "trainpipe.trainer.model:gpt" in line, line
    assert not trace.exists()  # never imported


@pytest.mark.timeout(60)
def test_a_recorded_profile_that_does_not_match_the_tensors_is_refused_before_its_model_is_built(run_ckpt, monkeypatch):
    """A bucket writer raises the recorded ``n_embd``: validate would build (allocate) the model it describes before
    DCP found the shapes wrong. Its shapes are checked against the checkpoint's tensor metadata first, on the meta
    device; the real model is never built."""
    from trainpipe.trainer.checkpoint import validate

    uri, _, _ = run_ckpt
    body = profile().public()
    body["model"] |= {"n_embd": 4096, "n_head": 4}  # 4096² weights a layer: far more than the checkpoint holds
    _tamper(uri, lambda m: {**m, "profile": body})
    built, real = [], validate.build_model

    def build(cfg):
        built.append(torch.empty(0).device.type)  # where its tensors go: the meta device allocates nothing
        return real(cfg)

    monkeypatch.setattr(validate, "build_model", build)
    with pytest.raises(CheckpointError) as exc:
        validate_checkpoint(uri, profile())
    line = one_line(exc)
    assert "does not match its tensors" in line and "[256, 4096] against [256, 32]" in line, line
    assert built == ["meta"]  # the real model was never built
    _tamper(uri, lambda m: {**m, "profile": profile().public()})
    body["model"] |= {"n_embd": 32, "n_layer": 10**6}  # deep enough to take hours even on the meta device
    _tamper(uri, lambda m: {**m, "profile": body})
    with pytest.raises(CheckpointError, match="asks for 1000000 layers and its tensors hold 1"):
        validate_checkpoint(uri, profile())
    assert built == ["meta"]  # not even sized
    _tamper(uri, lambda m: {**m, "profile": profile().public()})
    with pytest.raises(CheckpointError, match="names no dataset"):  # its own profile loads: on to the next check
        validate_checkpoint(uri, profile())


def test_a_recorded_factory_must_be_the_callers_or_else_a_built_in_one():
    assert recorded_factory_problem("trainpipe.trainer.model:gpt", "trainpipe.trainer.model:gpt") is None
    assert recorded_factory_problem("tests.user_model:tiny", "tests.user_model:tiny") is None
    mismatch = recorded_factory_problem("antigravity:x", "trainpipe.trainer.model:gpt")
    assert "antigravity:x" in mismatch and "trainpipe.trainer.model:gpt" in mismatch
    assert recorded_factory_problem("trainpipe.trainer.hf:causal_lm", None) is None
    assert (
        recorded_factory_problem("trainpipe.trainer.hf:causal_lm", "trainpipe.trainer.model:gpt") is None
    )  # trainpipe's own
    assert "not a built-in one" in recorded_factory_problem("this:x", None)
    for hostile in ("os:system\n", "x:y; rm -rf /", 7, None, "\x1b]0;title\x07:x"):
        problem = recorded_factory_problem(hostile, None)
        assert problem is not None and "\n" not in problem and "\x1b" not in problem, problem


@pytest.mark.parametrize(
    "model",
    [[], {"factory": 7}, {"factory": "os:system\n"}, {"factory": "\x1b[2J:x"}],
    ids=["list", "int", "nl", "esc"],
)
def test_ckpt_inspect_shows_no_recorded_factory_that_is_not_a_factory_name(ckpt_root, cli, model):
    root, uri = ckpt_root
    _tamper(uri, lambda m: {**m, "profile": {"model": model}})
    code, out, err = cli("ckpt", "inspect", uri)
    assert code == 1 and "INVALID: manifest field profile.model" in out, out + err
    assert "\x1b" not in out and "Traceback" not in err
    code, out, err = cli("ckpt", "list", str(root))
    assert code == 0 and "INVALID (manifest field profile.model" in out, out + err


@pytest.fixture
def ckpt_root(tmp_path):
    root = tmp_path / "checkpoints"
    model, optimizer = trained_model()
    return root, save(root, 1, model, optimizer)


# ---------------------------------------------------------------- 2. DCP's metadata naming files elsewhere


def _point_tensors_at(uri: str, where: str) -> None:
    """Rewrite ``.metadata`` so that the model's tensors are read from ``where`` (the real file copied there), and
    zero the tensor data inside the folder: every checksum in the manifest still matches."""
    folder = Path(uri)
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # the test's own checkpoint: trusted here
    data = next(p for p in folder.glob("*.distcp"))
    outside = folder.parent.parent / "outside.distcp"
    shutil.copy(data, outside)
    target = str(outside) if where == "absolute" else os.path.relpath(outside, folder)
    for info in metadata.storage_data.values():
        info.relative_path = target
    _plant(uri, ".metadata", pickle.dumps(metadata))
    _plant(uri, data.name, bytes(data.stat().st_size))


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_dcp_metadata_naming_a_file_outside_the_manifest_is_refused_before_it_is_read(run_ckpt, where):
    uri, _, model = run_ckpt
    _point_tensors_at(uri, where)
    manifest = inspect_checkpoint(uri).manifest
    assert manifest["files"]  # valid: every file the manifest lists matches
    fresh = GPT(CFG)
    for expected, why in ((manifest["files"], "not one of its manifest's files"), (None, "outside its checkpoint")):
        with pytest.raises(ChecksumMismatch) as exc:
            load_checkpoint(uri, {"model": fresh.state_dict()}, expected=expected)
        assert "outside.distcp" in one_line(exc) and why in str(exc.value)
    assert model_digest(fresh.state_dict()) != model_digest(model.state_dict())  # nothing came from outside
    with pytest.raises(CheckpointError, match="not one of its manifest's files"):
        validate_checkpoint(uri, profile())


# ---------------------------------------------------------------- 3. links, pipes, devices and sizes


def _replace_with(path: Path, kind: str, target: Path | None = None) -> None:
    path.unlink()
    if kind == "symlink to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)  # nobody ever writes it: an open for reading waits forever
    else:  # a link to a copy of the very file: its sha256 matches, and still it is not the checkpoint's own
        path.symlink_to(target)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["symlink to /dev/zero", "fifo", "symlink to a copy"])
@pytest.mark.parametrize("rel", [".metadata", "extra/rank-00000.pt", MANIFEST])
def test_a_link_pipe_or_device_in_a_checkpoint_is_invalid_at_once(ckpt_root, cli, kind, rel):
    root, uri = ckpt_root
    path = Path(uri) / rel
    copy = path.parent.parent / f"copy-{path.name}"
    shutil.copy(path, copy)
    _replace_with(path, kind, copy)
    info = inspect_checkpoint(uri)
    assert not info.valid and rel in info.reason, info.reason
    assert "not a regular file" in info.reason, info.reason
    assert [i.valid for i in list_checkpoints(str(root))] == [False]
    code, out, _ = cli("ckpt", "list", str(root))
    assert code == 0 and "not a regular file" in out
    if rel == MANIFEST:
        return
    state = {"model": GPT(CFG).state_dict()}
    files = json.loads((Path(uri) / MANIFEST).read_text())["files"]
    with pytest.raises(ChecksumMismatch, match="not a regular file") as exc:
        if rel == ".metadata":
            load_checkpoint(uri, state, expected=files)
        else:
            load_rank_extra(uri, 0, expected=files)
    one_line(exc)


@pytest.mark.timeout(20)
def test_a_checkpoint_folder_behind_a_linked_subfolder_is_invalid(ckpt_root):
    """``extra`` linked to a folder elsewhere: the file under it lies outside the checkpoint."""
    _, uri = ckpt_root
    elsewhere = Path(uri).parent.parent / "elsewhere"
    shutil.move(Path(uri) / "extra", elsewhere)
    (Path(uri) / "extra").symlink_to(elsewhere)
    info = inspect_checkpoint(uri)
    assert not info.valid and "extra/rank-00000.pt" in info.reason and "not a regular file" in info.reason
    with pytest.raises(ChecksumMismatch, match="not a regular file"):
        load_rank_extra(uri, 0, expected=json.loads((Path(uri) / MANIFEST).read_text())["files"])


def test_the_manifest_states_every_files_size_and_a_file_of_another_size_is_invalid_before_it_is_hashed(
    ckpt_root, monkeypatch
):
    _, uri = ckpt_root
    manifest = json.loads((Path(uri) / MANIFEST).read_text())
    on_disk = {str(p.relative_to(uri)): p.stat().st_size for p in Path(uri).rglob("*") if p.is_file()}
    assert manifest["sizes"] == {rel: on_disk[rel] for rel in manifest["files"]}
    victim = Path(uri) / ".metadata"
    with victim.open("ab") as fh:  # grown (or truncated): the size says so before a byte is hashed
        fh.write(b"\0" * 10)
    hashed: list[str] = []
    real = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda *a: hashed.append("x") or real(*a))
    info = inspect_checkpoint(uri)
    size = on_disk[".metadata"]
    assert not info.valid and info.reason == f"file .metadata has {size + 10} bytes, its manifest says {size}"
    assert hashed == []
    _tamper(uri, lambda m: {**m, "sizes": {**m["sizes"], ".metadata": -1}})
    assert "manifest entry '.metadata' has no size" in inspect_checkpoint(uri).reason


@pytest.mark.timeout(20)
def test_a_manifest_without_sizes_still_reads_only_regular_files(ckpt_root):
    """Checkpoints written before the manifest stated sizes: each file is read up to the size it has."""
    _, uri = ckpt_root
    _tamper(uri, lambda m: {k: v for k, v in m.items() if k != "sizes"})
    assert inspect_checkpoint(uri).valid
    state = {"model": GPT(CFG).state_dict()}
    load_checkpoint(uri, state, expected=inspect_checkpoint(uri).manifest["files"])
    (Path(uri) / ".metadata").unlink()
    (Path(uri) / ".metadata").symlink_to("/dev/zero")
    assert "not a regular file" in inspect_checkpoint(uri).reason


# ---------------------------------------------------------------- 4. records read whole are bounded


@pytest.mark.timeout(20)
def test_a_huge_manifest_is_invalid_without_being_read(ckpt_root):
    _, uri = ckpt_root
    with (Path(uri) / MANIFEST).open("r+b") as fh:
        fh.truncate(MANIFEST_MAX_BYTES + 1)  # sparse: no disk, and a reader that reads it whole holds all of it
    info = inspect_checkpoint(uri)
    assert not info.valid and not info.committed
    assert info.reason == f"{MANIFEST} is {MANIFEST_MAX_BYTES + 1} bytes, more than a manifest's {MANIFEST_MAX_BYTES}"


@pytest.mark.timeout(20)
def test_a_huge_run_profile_is_refused_without_being_read(run_ckpt):
    uri, paths, _ = run_ckpt
    with open(paths.profile, "wb") as fh:
        fh.truncate(MANIFEST_MAX_BYTES + 1)
    with pytest.raises(CheckpointError, match=f"profile.yaml is {MANIFEST_MAX_BYTES + 1} bytes") as exc:
        validate_checkpoint(uri, profile())
    one_line(exc)


# ---------------------------------------------------------------- an object store


@pytest.mark.timeout(120)
def test_on_s3_a_file_of_another_size_is_invalid_before_it_is_read(s3_bucket):
    from trainpipe.trainer.checkpoint.checkpointer import Checkpointer
    from trainpipe.trainer.store import filesystem

    bucket, options = s3_bucket
    root = f"s3://{bucket}/runs/r/checkpoints"
    model, _ = trained_model()
    Checkpointer(root, 5, options, use_async=False).save(1, {"model": model.state_dict()}, {"step": 1}, {"step": 1})
    uri = step_uri(root, 1)
    assert inspect_checkpoint(uri, options).valid
    fs, base = filesystem(uri, options)
    manifest = json.loads(fs.cat_file(f"{base}/{MANIFEST}"))
    size = manifest["sizes"][".metadata"]
    fs.pipe_file(f"{base}/.metadata", bytes(size + 5))
    info = inspect_checkpoint(uri, options)
    assert not info.valid and info.reason == f"file .metadata has {size + 5} bytes, its manifest says {size}"
    with pytest.raises(ChecksumMismatch, match=r"has .* bytes, its manifest says"):
        load_checkpoint(uri, {"model": GPT(CFG).state_dict()}, options, manifest["files"], sizes=manifest["sizes"])
