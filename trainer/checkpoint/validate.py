"""Prove a checkpoint is complete, uncorrupted, loadable and sane before anyone trusts it."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from trainer.checkpoint.catalog import require_valid
from trainer.checkpoint.loading import load_checkpoint
from trainer.config import Profile, build_profile, load_resolved_profile
from trainer.data.format import require_one_block, require_vocab
from trainer.data.tokens import TokenStream
from trainer.errors import CheckpointError, ProfileError
from trainer.evaluation import eval_windows, mean_loss
from trainer.factory import build_model
from trainer.layout import profile_of_checkpoint
from trainer.model import model_digest
from trainer.store import filesystem

EVAL_WINDOWS, EVAL_BATCH = 32, 8


def load_model(uri: str, profile: Profile, storage_options: dict[str, Any] | None = None) -> torch.nn.Module:
    """A fresh model of the profile's factory with the checkpoint's weights (single process, no process group)."""
    model = build_model(profile.model)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        load_checkpoint(uri, state, storage_options)
    model.load_state_dict(state["model"])
    return model


def run_profile_for(uri: str, manifest: dict[str, Any], fallback: Profile) -> Profile:
    """The profile the checkpoint was trained with: the one its manifest records (a later start of the run may
    have rewritten {run}/profile.yaml), else that file, else ``fallback``. The store settings stay the caller's:
    credentials and endpoints are not the recorded run's."""
    recorded = manifest.get("profile")
    if isinstance(recorded, dict):
        body = {**recorded, "store": fallback.store.model_dump(mode="json")}
        try:
            return build_profile(body, origin=f"{uri} (the profile its manifest records)")
        except ProfileError as exc:
            raise CheckpointError(f"checkpoint {uri} records a profile that is not valid: {exc}") from None
    path = profile_of_checkpoint(uri)
    fs, local = filesystem(path, fallback.store.storage_options)
    if not fs.exists(local):
        return fallback
    profile = load_resolved_profile(path, fallback.store.storage_options)
    profile.store = fallback.store
    return profile


def validate_checkpoint(uri: str, profile: Profile, max_val_loss: float | None = None) -> dict[str, Any]:
    """Checksums, loadability, digest, finiteness and validation loss; raises CheckpointError on any failure."""
    so = profile.store.storage_options
    info = require_valid(uri, so)
    manifest = info.manifest
    profile = run_profile_for(uri, manifest, profile)
    model = load_model(uri, profile, so)
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
    }
