"""``trainpipe models export``: a committed checkpoint as a Hugging Face folder that stock transformers loads.

The weights stream block by block from DCP's files into a safetensors file laid out from the shapes; each file
is verified as it streams and the written weights hash back to the checkpoint's recorded digest. Logits of the
export equal trainpipe's forward (``tests/hf_check.py``); the layouts' own exports are checked where those runs
train (``test_parallel_layouts.py``, ``test_virtual_ranks.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from tests.conftest import TINY
from tests.hf_check import exported_logits_match, tokenizer_encodes_as_the_runs
from trainpipe.trainer.checkpoint.files import ChecksumMismatch
from trainpipe.trainer.errors import CheckpointError, ExportError
from trainpipe.trainer.export.consolidate import model_layout
from trainpipe.trainer.export.folder import export_checkpoint
from trainpipe.trainer.export.safetensors_out import SafetensorsOut, TensorSpec
from trainpipe.trainer.profile_files import load_profile

pytestmark = pytest.mark.usefixtures("warm_module")  # its attempts fork their agents (conftest)

LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
RUNS = {
    "gpt-ddp": ["train.strategy=ddp", "cluster.procs_per_node=2"],
    "llama-tp": [
        "train.strategy=fsdp",
        "cluster.procs_per_node=4",
        "parallel.tp=2",
        "model.factory=trainpipe.trainer.hf:causal_lm",
        f"model.config={json.dumps(LLAMA)}",
        "data.tokenizer=bpe",
        "data.vocab_size=512",
        "model.vocab_size=512",
    ],
}
USER_MODEL = ["train.strategy=ddp", "model.factory=tests.user_model:bigram", "model.config={width: 16}"]


def test_a_safetensors_file_written_block_by_block_loads_as_written(tmp_path):
    g = torch.Generator().manual_seed(0)
    whole = {
        "rows": torch.randn(6, 4, generator=g),
        "cols": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "cube": torch.randn(2, 3, 4, generator=g),
        "bias": torch.randn(5, generator=g),
        "scalar": torch.tensor(3.5),
    }
    out = SafetensorsOut(
        str(tmp_path / "m.safetensors"), {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in whole.items()}
    )
    out.put("rows", whole["rows"][3:], (3, 0))  # out of order: the second half first
    out.put("rows", whole["rows"][:3], (0, 0))
    out.put("cols", whole["cols"][:, 3:], (0, 3))  # column blocks: strided in the file
    out.put("cols", whole["cols"][:2, :3], (0, 0))
    out.put("cols", whole["cols"][2:, :3], (2, 0))
    assert out.filled() == ["bias", "cube", "scalar"]
    out.put("cube", whole["cube"][:, :, 2:], (0, 0, 2))
    out.put("cube", whole["cube"][:, :, :2], (0, 0, 0))
    out.put("bias", whole["bias"], (0,))
    out.put("scalar", whole["scalar"], ())
    out.put("bias", whole["bias"], (0,))  # a retried read writes a block again: counted once
    assert out.filled() == []
    with pytest.raises(ValueError, match="outside"):
        out.put("bias", whole["bias"][:2], (4,))
    out.close()
    back = load_file(str(tmp_path / "m.safetensors"))
    assert set(back) == set(whole) and all(torch.equal(back[k], v) for k, v in whole.items())
    with pytest.raises(FileExistsError):  # never over an existing file
        SafetensorsOut(str(tmp_path / "m.safetensors"), {"x": TensorSpec(torch.float32, (1,))})


def _metadata(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], shape=(4, 4), files=None) -> Metadata:
    meta = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(shape),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    storage = {
        MetadataIndex("model.w", torch.Size(o), i): _StorageInfo((files or {}).get(i, "__0_0.distcp"), 100 * i, 90)
        for i, (o, _) in enumerate(chunks)
    }
    return Metadata({"model.w": meta}, storage_data=storage)


@pytest.mark.parametrize(
    "chunks, says",
    [
        ([((0, 0), (2, 4)), ((2, 0), (2, 4))], None),
        ([((0, 0), (2, 4)), ((1, 0), (3, 4))], "do not cover it exactly"),  # overlapping, more than it holds
        ([((0, 0), (3, 4)), ((2, 0), (1, 4))], "overlap"),  # overlapping, volumes adding up
        ([((0, 0), (2, 4)), ((3, 0), (2, 4))], "outside its shape"),
        ([((0, 0), (2, 4))], "do not cover it exactly"),  # a gap
    ],
)
def test_blocks_that_do_not_tile_their_weight_are_refused(chunks, says):
    if says is None:
        layout = model_layout("ckpt", _metadata(chunks), {"__0_0.distcp": 1000})
        assert [b.at for b in layout.files["__0_0.distcp"]] == [(0, 0), (2, 0)]
        return
    with pytest.raises(CheckpointError, match=says):
        model_layout("ckpt", _metadata(chunks), {"__0_0.distcp": 1000})


def test_a_block_said_to_lie_beyond_its_file_or_in_an_unlisted_one_is_refused():
    halves = [((0, 0), (2, 4)), ((2, 0), (2, 4))]
    with pytest.raises(ChecksumMismatch, match="outside the files"):
        model_layout("ckpt", _metadata(halves), {"__0_0.distcp": 150})  # the second block ends at 190
    with pytest.raises(ChecksumMismatch, match="outside the files"):
        model_layout("ckpt", _metadata(halves, files={1: "../elsewhere"}), {"__0_0.distcp": 1000})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name → (profile, checkpoint URI, dataset URI): a GPT under DDP on bytes, a Llama under tp 2 on bpe."""
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.supervise.attempt import train_attempt

    done = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINPIPE_HOME", str(tmp_path_factory.mktemp("export") / "home"))
        for name, sets in {**RUNS, "user-model": USER_MODEL}.items():
            prof = load_profile("local", [*TINY, "tracking.enabled=false", "preflight.enabled=false", *sets])
            dataset = shard_dataset(prof.data, prof.store).uri
            run = train_attempt(prof, name, dataset)
            assert run.result is not None, "\n".join(run.job.tail[-30:])
            done[name] = (prof, run.result.checkpoint_uri, dataset)
        yield done


@pytest.mark.distributed
@pytest.mark.parametrize("name", RUNS)
def test_an_export_loads_in_stock_transformers_with_trainpipes_logits(trained, name, tmp_path):
    prof, uri, dataset = trained[name]
    report = export_checkpoint(uri, tmp_path / "model", prof)
    assert sorted(report.files) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert report.model_type == ("gpt2" if name.startswith("gpt") else "llama")
    exported_logits_match(uri, tmp_path / "model", prof)
    tokenizer_encodes_as_the_runs(tmp_path / "model", dataset)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["eos_token_id"] == 0 and "auto_map" not in config  # the run's end-of-text; no remote code


@pytest.mark.distributed
def test_the_cli_exports_once_and_refuses_a_folder_that_holds_something(trained, tmp_path, cli, monkeypatch):
    prof, uri, _ = trained["gpt-ddp"]
    monkeypatch.setenv("TRAINPIPE_HOME", str(Path(prof.store.root).parent))
    code, out, err = cli("models", "export", uri, "-o", str(tmp_path / "m"), "--json")
    assert code == 0, err
    report = json.loads(out.splitlines()[-1])
    assert report["model_digest"] == json.loads((Path(uri) / "trainpipe.json").read_text())["model_digest"]
    code, out, err = cli("models", "export", uri, "-o", str(tmp_path / "m"))
    assert (
        code == 2 and err.strip() == f"error: {tmp_path / 'm'} exists and is not an empty folder; export into a new one"
    )


@pytest.mark.distributed
def test_an_altered_checkpoint_file_exports_nothing(trained, tmp_path):
    import shutil

    prof, uri, _ = trained["gpt-ddp"]
    copy = tmp_path / "step-00000008"
    shutil.copytree(uri, copy)
    target = copy / "__1_0.distcp"
    data = bytearray(target.read_bytes())
    data[-10] ^= 0xFF  # past every model block: only the whole file's hash can tell
    target.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match=r"__1_0\.distcp fails its sha256"):
        export_checkpoint(str(copy), tmp_path / "out", prof)
    assert os.listdir(tmp_path) == ["step-00000008"]  # no folder, no half-written one beside it


@pytest.mark.distributed
def test_a_state_that_does_not_add_up_to_its_proof_exports_nothing(trained, tmp_path):
    """A bucket writer who rewrote a checkpoint's proof (or a record and its file's sha256 together): the records,
    summed as they stream, no longer add up to the state hash the ranks recorded."""
    import shutil

    prof, uri, _ = trained["gpt-ddp"]
    copy = tmp_path / "step-00000008"
    shutil.copytree(uri, copy)
    manifest = json.loads((copy / "trainpipe.json").read_text())
    recorded = manifest["proof"]["state"]
    manifest["proof"]["state"] = "0" * 32
    (copy / "trainpipe.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"its proof records {'0' * 32}; nothing was exported"):
        export_checkpoint(str(copy), tmp_path / "out", prof, check_state=True)
    assert not (tmp_path / "out").exists()
    assert export_checkpoint(uri, tmp_path / "ok", prof, check_state=True).state_hash == recorded


@pytest.mark.distributed
def test_a_model_with_no_stock_architecture_is_one_line_and_the_checkpoint_stays(trained, tmp_path):
    prof, uri, _ = trained["user-model"]
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(uri).iterdir())
    with pytest.raises(ExportError) as err:
        export_checkpoint(uri, tmp_path / "out", prof)
    assert str(err.value) == (
        "model.factory tests.user_model:bigram has no stock transformers equivalent to export to (trainpipe "
        "exports trainpipe.trainer.hf:causal_lm and trainpipe.trainer.model:gpt); the checkpoint stays as it is"
    )
    assert sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(uri).iterdir()) == before
    assert not (tmp_path / "out").exists()
