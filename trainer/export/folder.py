"""A committed checkpoint as a Hugging Face folder: ``config.json``, ``generation_config.json``,
``model.safetensors`` and the run's tokenizer, which ``AutoModelForCausalLM`` and ``AutoTokenizer`` load as
they are (docs/architecture.md §11).

The checkpoint is read as validation reads it (its manifest, the profile it records, DCP metadata through the
safe unpickler, shapes against the model), its weights streamed block by block into place
(``trainer.export.consolidate``), then read back out of the written file and hashed: the digest must be the one
the checkpoint's manifest records, so the folder holds exactly the checkpoint's weights, bit for bit. The
folder is built beside ``out`` and renamed into place only then: a failed export leaves nothing at ``out``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainpipe.trainer.checkpoint.catalog import inspect_checkpoint
from trainpipe.trainer.checkpoint.loading import SafeReader, read_metadata
from trainpipe.trainer.checkpoint.state_hash import position_sum
from trainpipe.trainer.checkpoint.validate import require_shapes, run_profile_for
from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import CheckpointError, ExportError
from trainpipe.trainer.export.architectures import HFModel, export_spec
from trainpipe.trainer.export.consolidate import Block, ModelLayout, Streamed, model_layout, stream_model
from trainpipe.trainer.export.safetensors_out import SafetensorsOut
from trainpipe.trainer.export.tokenizer import save_tokenizer
from trainpipe.trainer.model import streamed_digest

WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote: the folder, its files' sha256, and what it proves about them."""

    uri: str
    folder: str
    step: int
    model_type: str
    model_digest: str  # the checkpoint's, recomputed from the written weights
    files: dict[str, str] = field(default_factory=dict)  # name → sha256
    weight_bytes: int = 0
    largest_tensor_bytes: int = 0
    read_bytes: int = 0  # of the checkpoint's files, every byte hashed
    dataset_uri: str = ""
    tokenizer: str = ""
    block_size: int = 0  # the run's context: the windows its val loss is measured on
    state_hash: str = ""  # the proof's state hash, recomputed from every record (check_state), else ""


def export_checkpoint(
    uri: str, out: str | os.PathLike[str], profile: Profile, check_state: bool = False
) -> ExportReport:
    """Export the committed checkpoint ``uri`` to the new folder ``out``; CheckpointError, ExportError or
    DataError, in one line, when it cannot be. ``check_state``: read every record of the state as the files
    stream (not only the model's) and recompute the state hash its proof records, which must match."""
    so = profile.store.storage_options
    info = inspect_checkpoint(uri, so, verify=False)  # its files are verified as they stream: read once, not twice
    if not info.valid:
        raise CheckpointError(f"checkpoint {uri} is not usable: {info.reason}")
    manifest = info.manifest
    run_profile = run_profile_for(uri, manifest, profile)
    files, sizes = manifest.get("files") or {}, manifest.get("sizes") or {}
    metadata = read_metadata(uri, SafeReader(uri, files, sizes, **so))
    require_shapes(uri, run_profile, metadata, sizes)
    layout = model_layout(uri, metadata, sizes, whole=check_state)
    hf = export_spec(run_profile.model, layout.weights)
    recorded, dataset_uri = manifest.get("model_digest"), manifest.get("dataset_uri")
    if not recorded or not dataset_uri:
        raise CheckpointError(f"checkpoint {uri} records no model digest or dataset; export needs both to check it")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"{target} exists and is not an empty folder; export into a new one")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))  # 0700, beside it: one rename
    try:
        written_file, streamed = _write_weights(uri, work / WEIGHTS, layout, hf, files, sizes, so)
        state_hash = _require_state(uri, manifest, streamed) if check_state else ""
        with ThreadPoolExecutor(1) as pool:  # the file's sha256 beside the digest: two passes over it at once
            weights_sha = pool.submit(_sha256, work / WEIGHTS)
            digest = streamed_digest(_weights_back(written_file, layout, hf))
        if digest != recorded:
            raise CheckpointError(
                f"checkpoint {uri}: the exported weights hash to {digest[:12]}, its manifest records "
                f"{recorded[:12]}; nothing was exported"
            )
        tok = save_tokenizer(dataset_uri, work, so)
        hf.config.bos_token_id = hf.config.eos_token_id = tok.eot  # the run's end-of-text, not the config's default
        hf.config.pad_token_id = None
        hf.config.save_pretrained(str(work))
        _generation_config(hf.config, work)
        written = {p.name: _sha256(p) if p.name != WEIGHTS else weights_sha.result() for p in sorted(work.iterdir())}
        if target.exists():
            target.rmdir()
        work.rename(target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    sizes_of = [s.nbytes for s in hf.tensors.values()]
    return ExportReport(
        uri=uri,
        folder=str(target),
        step=info.step,
        model_type=hf.config.model_type,
        model_digest=digest,
        files=written,
        weight_bytes=sum(sizes_of),
        largest_tensor_bytes=max(sizes_of),
        read_bytes=streamed.read,
        state_hash=state_hash,
        dataset_uri=dataset_uri,
        tokenizer=tok.kind,
        block_size=run_profile.model.block_size,
    )


def _write_weights(
    uri: str,
    path: Path,
    layout: ModelLayout,
    hf: HFModel,
    files: dict[str, str],
    sizes: dict[str, int],
    storage_options: dict[str, Any],
) -> tuple[SafetensorsOut, Streamed]:
    out = SafetensorsOut(str(path), hf.tensors, {"format": "pt"})
    try:

        def put(block: Block, tensor: torch.Tensor) -> None:
            placement = hf.placements[block.name]
            if not placement.tied:  # its twin writes the bytes; the digest below checks the two agree
                out.put(placement.target, *placement.place(tensor, block.at))

        streamed = stream_model(uri, layout, files, sizes, put, storage_options)
    finally:
        out.close()
    if unfilled := out.filled():
        raise CheckpointError(f"checkpoint {uri}: its blocks do not fill {unfilled[0]} of the export")
    return out, streamed


def _require_state(uri: str, manifest: dict[str, Any], streamed: Streamed) -> str:
    """The state hash the records streamed add up to (with the data position), which must be the proof's."""
    recorded = (manifest.get("proof") or {}).get("state")
    if not isinstance(recorded, str) or streamed.state is None:
        raise CheckpointError(f"checkpoint {uri} records no state hash (written before proofs): nothing to check it by")
    found = (streamed.state + position_sum(manifest.get("data_position"))).hex()
    if found != recorded:
        raise CheckpointError(
            f"checkpoint {uri}: its records hash to the state {found}, its proof records {recorded}; nothing was "
            "exported"
        )
    return found


def _weights_back(out: SafetensorsOut, layout: ModelLayout, hf: HFModel) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's weights, in name order, read back out of the written file a few targets at a time."""
    held: dict[str, torch.Tensor] = {}  # the last few targets: a layer's weights interleave in name order
    for name in sorted(layout.weights):
        placement = hf.placements[name]
        if placement.target not in held:
            while len(held) >= _HELD:
                held.pop(next(iter(held)))
            held[placement.target] = out.read(placement.target)
        yield name, placement.take(held[placement.target], layout.weights[name].shape)


_HELD = 4  # GPT-2's c_attn serves q, k and v, between which c_proj's and others' names sort


def _generation_config(config: Any, folder: Path) -> None:
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(config)
    generation.pad_token_id = config.eos_token_id  # documents are packed: no padding id of its own
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions:  # prompt and generated text together: a learned position table has no row past its last
        generation.max_length = positions
    generation.save_pretrained(str(folder))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(4 << 20):
            digest.update(block)
    return digest.hexdigest()
