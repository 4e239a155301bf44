"""Prove a checkpoint is complete, uncorrupted, loadable and sane before anyone trusts it."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from trainpipe.trainer.checkpoint.catalog import MANIFEST_MAX_BYTES, require_valid
from trainpipe.trainer.checkpoint.files import ChecksumMismatch, read_file
from trainpipe.trainer.checkpoint.loading import SafeReader, load_checkpoint, read_metadata
from trainpipe.trainer.config import GPT_FACTORY, Profile
from trainpipe.trainer.data.format import require_one_block, require_vocab
from trainpipe.trainer.data.tokens import TokenStream
from trainpipe.trainer.errors import CheckpointError, ProfileError
from trainpipe.trainer.evaluation import eval_windows, mean_loss
from trainpipe.trainer.factory import build_model, recorded_factory_problem
from trainpipe.trainer.model import model_digest
from trainpipe.trainer.profile_files import build_profile, profile_from_yaml
from trainpipe.trainer.store import filesystem
from trainpipe.trainer.store_paths import RUN_PROFILE, run_of_checkpoint

EVAL_WINDOWS, EVAL_BATCH = 32, 8  # compare.LEGEND names the 32 (tests/test_tracking.py checks it)
_INDEX = re.compile(r"\.(?:blocks|layers|h)\.(\d+)\.")  # a layer's number: model.blocks.3.attn.q.weight


def load_model(
    uri: str, profile: Profile, storage_options: dict[str, Any] | None = None, manifest: dict[str, Any] | None = None
) -> torch.nn.Module:
    """A fresh model of the profile's factory with the checkpoint's weights (single process, no process group),
    read only from the files ``manifest`` lists, each verified as it is read. The model is built only once its
    shapes are the checkpoint's own (``require_shapes``)."""
    files, sizes = (manifest or {}).get("files"), (manifest or {}).get("sizes")
    require_shapes(uri, profile, read_metadata(uri, SafeReader(uri, files, sizes, **(storage_options or {}))), sizes)
    model = build_model(profile.model)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        load_checkpoint(uri, state, storage_options, expected=files, sizes=sizes)
    model.load_state_dict(state["model"])
    return model


def require_shapes(uri: str, profile: Profile, metadata: Metadata, sizes: dict[str, int] | None) -> None:
    """CheckpointError unless the model ``profile`` describes has the checkpoint's own tensors: every weight of the
    same name and shape in its DCP metadata, and no more bytes than its files hold. The profile may be the one the
    checkpoint records, in a store others may write: a forged ``n_embd`` would size the model built to load it.
    The model is sized on the meta device, which allocates nothing, once its depth is the checkpoint's: building a
    forged million layers would take hours even there."""
    weights = [key for key in metadata.state_dict_metadata if key.startswith("model.")]  # not the optimizer's ids
    held_layers = 1 + max((int(i) for key in weights for i in _INDEX.findall(key)), default=-1)
    asked = profile.model.n_layer if profile.model.factory == GPT_FACTORY else None
    asked = (profile.model.config or {}).get("num_hidden_layers", asked)
    if isinstance(asked, int) and asked > held_layers:
        raise CheckpointError(
            f"checkpoint {uri} is not validated: its profile asks for {asked} layers and its tensors hold "
            f"{held_layers}; was the recorded profile changed?"
        )
    with torch.device("meta"):
        shell = build_model(profile.model).state_dict()
    held = metadata.state_dict_metadata
    for name, tensor in shell.items():
        found = getattr(held.get(f"model.{name}"), "size", None)
        if found is None or tuple(found) != tuple(tensor.shape):
            has = "no such tensor" if found is None else f"{list(found)}"
            raise CheckpointError(
                f"checkpoint {uri} is not validated: the model its profile describes does not match its tensors "
                f"(model.{name}: {list(tensor.shape)} against {has}); was the recorded profile changed?"
            )
    needed = sum(t.numel() * t.element_size() for t in shell.values())
    if sizes is not None and needed > sum(v for v in sizes.values() if type(v) is int):
        raise CheckpointError(
            f"checkpoint {uri} is not validated: its model needs {needed} bytes of weights, more than its files hold"
        )


def run_profile_for(uri: str, manifest: dict[str, Any], fallback: Profile) -> Profile:
    """The profile the checkpoint was trained with: the one its manifest records (a later start of the run may
    have rewritten {run}/profile.yaml), else that file, else ``fallback``. The store settings stay the caller's:
    credentials and endpoints are not the recorded run's. Its ``model.factory`` must be a built-in one or the
    caller's (``fallback``'s): a recorded one is never imported on the store's word alone."""
    recorded = manifest.get("profile")
    if isinstance(recorded, dict):
        factory = (recorded.get("model") or {}).get("factory", GPT_FACTORY)
        _require_factory(uri, factory, fallback)
        body = {**recorded, "store": fallback.store.model_dump(mode="json")}
        try:
            return build_profile(body, origin=f"{uri} (the profile its manifest records)")
        except ProfileError as exc:
            first = (str(exc).splitlines() or [""])[0][:300]
            raise CheckpointError(f"checkpoint {uri} records a profile that is not valid: {first}") from None
    fs, run = filesystem(run_of_checkpoint(uri), fallback.store.storage_options)
    try:  # bounded, a regular file only: the store is not trusted
        text = read_file(fs, run, RUN_PROFILE, limit=MANIFEST_MAX_BYTES, kind="profile")
    except FileNotFoundError:
        return fallback
    except ChecksumMismatch as exc:
        raise CheckpointError(
            f"checkpoint {uri} records no profile, and its run's {str(exc).removeprefix('file ')}: restore that "
            f"{RUN_PROFILE} or validate a checkpoint that records its profile"
        ) from None
    try:
        profile = profile_from_yaml(text.decode("utf-8"))
    except (UnicodeDecodeError, ProfileError) as exc:
        first = (str(exc).splitlines() or [""])[0][:300]
        raise CheckpointError(f"checkpoint {uri}: its run's {RUN_PROFILE} is not a valid profile: {first}") from None
    _require_factory(uri, profile.model.factory, fallback)
    profile.store = fallback.store
    return profile


def _require_factory(uri: str, recorded: object, caller: Profile) -> None:
    if problem := recorded_factory_problem(recorded, caller.model.factory):
        raise CheckpointError(f"checkpoint {uri} is not validated: {problem}")


def validate_checkpoint(uri: str, profile: Profile, max_val_loss: float | None = None) -> dict[str, Any]:
    """Checksums, loadability, digest, finiteness and validation loss; raises CheckpointError on any failure."""
    so = profile.store.storage_options
    info = require_valid(uri, so)
    manifest = info.manifest
    profile = run_profile_for(uri, manifest, profile)
    model = load_model(uri, profile, so, manifest)
    sd = model.state_dict()
    bad = [name for name, t in sd.items() if not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(f"checkpoint {uri} has non-finite weights in {', '.join(bad[:3])}")
    digest = model_digest(sd)
    if manifest.get("model_digest") and digest != manifest["model_digest"]:
        raise CheckpointError(f"checkpoint {uri}: loaded weights do not match the manifest's model digest")
    dataset_uri = manifest.get("dataset_uri")
    if not dataset_uri:
        raise CheckpointError(f"checkpoint {uri}: manifest names no dataset to evaluate on")
    val = TokenStream(dataset_uri, "val", so)
    block = profile.model.block_size
    require_one_block(val.manifest, block)
    require_vocab(val.manifest, profile.model.vocab_size)
    val_loss = mean_loss(model, val, eval_windows(val, block, EVAL_WINDOWS), block, EVAL_BATCH)
    if not math.isfinite(val_loss):
        raise CheckpointError(f"checkpoint {uri}: validation loss is {val_loss}")
    # A model that learned nothing sits at ln(vocab): the loss of uniform guessing.
    ceiling = max_val_loss if max_val_loss is not None else math.log(profile.model.vocab_size) * 1.05
    if val_loss > ceiling:
        raise CheckpointError(
            f"checkpoint {uri}: validation loss {val_loss:.3f} is above {ceiling:.3f}; the model is not sane"
        )
    return {
        "uri": uri,
        "step": info.step,
        "world_size": manifest.get("world_size"),
        "files_verified": len(manifest.get("files", {})),
        "model_digest": digest,
        "val_loss": val_loss,
        "config_hash": manifest.get("config_hash"),
        "state_hash": (manifest.get("proof") or {}).get("state"),
    }
