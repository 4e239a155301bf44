"""Every random number generator a rank uses, seeded, saved and restored (docs/architecture.md §4)."""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Tensors, numbers, strings and tuples only: a checkpoint's extras load with ``weights_only=True``."""
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())  # legacy=True: MT19937's tuple
    name, keys, pos, has_gauss, cached = legacy
    numpy = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    state = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
