"""What a resume must keep: the profile keys its weights were trained with (``RESUME_PINNED``), compared with a
checkpoint's recorded profile (``resume_differences``)."""

from __future__ import annotations

from typing import Any

from trainpipe.trainer.config import Profile, current_factory

# What a run's weights were trained with. Resuming under other values would continue those weights on different
# settings, so a resume must keep them; every other key (train.steps, train.micro_batch, cluster, checkpoint,
# watchdog, tracking, preflight, faults, cost, deploy, …) may change between starts of a run.
RESUME_PINNED = (
    "data",
    "model",
    "train.global_batch",
    "train.lr",
    "train.min_lr_ratio",
    "train.warmup_steps",
    "train.weight_decay",
    "train.betas",
    "train.grad_clip",
    "train.seed",
)
# Settings of how sharding runs, not of what it produces.
RESUME_FREE = ("data.buffer_mb", "data.max_bad_records", "data.engine", "data.workers")


def resume_differences(recorded: dict[str, Any], profile: Profile) -> list[str]:
    """``key (was → now)`` for each pinned key where ``profile`` differs from a checkpoint's recorded profile."""
    now = profile.public()  # as recorded: credentials redacted on both sides
    out = []
    for pinned in RESUME_PINNED:
        section, _, key = pinned.partition(".")
        keys = [key] if key else [k for k in now[section] if f"{section}.{k}" not in RESUME_FREE]
        before = recorded.get(section) or {}
        # A key the recorded profile lacks came with a later trainpipe: that run had what is now its default.
        default = type(getattr(profile, section))().model_dump(mode="json")
        for k in keys:
            was, new = before.get(k, default[k]), now[section][k]
            was = current_factory(was) if pinned == "model" and k == "factory" else was
            if was != new:
                out.append(f"{section}.{k} ({was!r} → {new!r})")
    return out
