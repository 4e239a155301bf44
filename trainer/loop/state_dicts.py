"""The model's and optimizer's state dicts as ``get_state_dict`` gives them, at a tenth of its cost, for plain tensors.

``torch.distributed.checkpoint.state_dict.get_state_dict`` names every parameter by walking the module tree on
each call: about 3 ms for a small GPT, most of a flash snapshot's work (docs/architecture.md §4, "Flash
snapshots"). Where the state is plain tensors (DDP or one rank: no DTensor, no pipeline), its result is the
module's own ``state_dict()`` and the optimizer's, renamed. ``PlainStateDicts`` learns that renaming from one
``get_state_dict`` call and applies it to the two native state dicts afterwards; it relearns whenever their
shape changes (a key, a parameter group, an optimizer state's entry appears or goes), and checks each learned
renaming against ``get_state_dict``'s own result: where the two differ in any key, value or tensor's storage,
it keeps calling ``get_state_dict``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

log = logging.getLogger("trainpipe.trainer")

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=False)


class PlainStateDicts:
    """``get(model, optimizer)``: the state dicts ``get_state_dict(model, optimizer)`` returns, unflattened."""

    def __init__(self) -> None:
        self._of: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None  # whose renaming it learned
        self._shape: tuple | None = None
        self._model_names: dict[str, str] = {}  # the module's own key -> get_state_dict's
        self._param_names: dict[int, str] = {}  # the optimizer's parameter index -> get_state_dict's name
        self.renamed = False  # whether the last learned renaming gives get_state_dict's result
        self.learned = 0  # how many times it learned one (each one get_state_dict call)

    def get(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        native_model, native_optim = model.state_dict(), optimizer.state_dict()
        shape = _shape(native_model, native_optim)
        of = self._of
        if shape == self._shape and of is not None and of[0] is model and of[1] is optimizer:
            if self.renamed:
                return self._rename(native_model, native_optim)
            return get_state_dict(model, optimizer, options=_OPTIONS)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
        self._learn(native_model, native_optim, model_sd, optim_sd)
        self._of, self._shape = (model, optimizer), shape
        return model_sd, optim_sd

    def _learn(self, native_model: dict, native_optim: dict, model_sd: dict, optim_sd: dict) -> None:
        self.learned += 1
        self._model_names = {k: _strip(k) for k in native_model}
        self._param_names = {}
        groups, named = native_optim.get("param_groups", []), optim_sd.get("param_groups", [])
        if len(groups) == len(named):
            for group, names in zip(groups, named, strict=True):
                if len(group["params"]) == len(names["params"]):
                    self._param_names.update(zip(group["params"], names["params"], strict=True))
        try:
            self.renamed = _same(self._rename(native_model, native_optim), (model_sd, optim_sd))
        except (KeyError, TypeError):
            self.renamed = False
        if not self.renamed:
            log.debug("state dicts: get_state_dict's names are not a renaming of the module's; calling it each time")

    def _rename(self, native_model: dict, native_optim: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        names = self._param_names
        model_sd = {self._model_names[k]: v for k, v in native_model.items()}
        optim_sd = {
            "state": {names[i]: s for i, s in native_optim["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in native_optim["param_groups"]],
        }
        return model_sd, optim_sd


def _strip(key: str) -> str:
    """A module's key without the wrappers' leading prefixes get_state_dict drops (DDP's ``module.``, compile's);
    any other difference fails the check of the renaming (``_same``)."""
    while key.startswith(("module.", "_orig_mod.")):
        key = key.split(".", 1)[1]
    return key


def _shape(native_model: dict, native_optim: dict) -> tuple:
    """What a renaming depends on: the module's keys, the optimizer's groups and each parameter's state's keys."""
    groups = tuple(tuple(g.get("params", ())) for g in native_optim.get("param_groups", ()))
    states = tuple((i, tuple(s)) for i, s in native_optim.get("state", {}).items())
    return tuple(native_model), groups, states, tuple(native_optim)


def _same(a: Any, b: Any) -> bool:
    """The same nesting, keys and values, each tensor a view of the same storage with the same layout."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and type(a) is type(b)
            and a.data_ptr() == b.data_ptr()
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.device == b.device
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b
