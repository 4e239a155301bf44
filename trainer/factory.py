"""Which model a run trains: ``model.factory`` names ``package.module:function``; the built-in GPT by default.

The protocol a model follows (the loop, evaluation and validation use nothing else):

- ``@model_factory`` marks the function; it takes the profile's ``ModelConfig`` (``config`` holds the
  free-form settings meant for it; ``vocab_size`` and ``block_size`` are the tokenizer's vocabulary and the
  sample length) and returns a ``torch.nn.Module``. It builds the same weights on every rank from the seed
  trainpipe sets before calling it.
- ``model(inputs, targets)``, two int64 tensors of shape (batch, block_size) where ``targets`` are the inputs
  shifted by one token, returns the mean cross-entropy loss: a scalar tensor, ``(logits, loss)``, or an object
  with a ``.loss`` (a transformers ``ModelOutput``).

Optional, for ``parallel`` layouts (docs/architecture.md §10):

- ``model.tensor_parallel_plan(tp, loss_parallel)`` returns a ``TensorParallelPlan``: DTensor parallel styles by
  module name (``parallelize_module``'s plan), whether the logits leave sharded over the vocabulary (the loss is
  then computed under ``loss_parallel()``), and the tied parameters to tie again after the split. It raises
  ValueError saying why when ``tp`` does not fit (heads or widths it does not divide). Without it, ``tp`` > 1 is
  refused.
- ``model.pipeline_stage(stage, stages)`` keeps, in place, only the modules of pipeline stage ``stage`` under
  their whole-model names, so checkpoints load across layouts; the model's forward then takes the previous
  stage's output (the token ids on the first) and returns the next stage's input (the logits on the last, whose
  mean cross-entropy trainpipe takes). It returns a ``StageSplit`` naming parameters the first and last stage
  each hold (a tied embedding and head), whose gradients are summed so they stay equal; ValueError when the
  model cannot be split so (more stages than layers). Without it, ``pp`` > 1 is refused.

Profiles are shared files (docs/security.md): a factory must carry the mark, so a profile cannot name an arbitrary
function (``os:system``) to be called. A factory read from the store (a checkpoint's recorded profile) is not
even imported unless the caller named it too (``recorded_factory_problem``): importing a module runs it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from trainpipe.trainer.config import ModelConfig, current_factory
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.parallel_dims import Layout

MARK = "__trainpipe_model_factory__"


@dataclass
class TensorParallelPlan:
    """How a model splits over tensor-parallel ranks (``model.tensor_parallel_plan``)."""

    styles: dict[str, Any]  # module name (fnmatch per dot-separated part) -> a DTensor ParallelStyle
    loss_parallel: bool = False  # the logits come out sharded over the vocabulary: compute the loss under loss_parallel
    tied: list[tuple[str, str]] = field(default_factory=list)  # (parameter, parameter tied to it) to tie again


@dataclass
class StageSplit:
    """What a pipeline stage split left to keep in step (``model.pipeline_stage``)."""

    tied: list[tuple[str, str]] = field(default_factory=list)  # (first stage's parameter, last stage's copy)


def stage_layers(layers: int, stage: int, stages: int) -> tuple[int, int]:
    """The layers ``[first, last)`` of pipeline stage ``stage`` of ``stages``: as even as they divide, the first
    stages taking one more (ValueError when there are fewer layers than stages)."""
    if stages > layers:
        raise ValueError(f"parallel.pp={stages} is more than the model's {layers} layers: each stage needs one")
    per, extra = divmod(layers, stages)
    first = stage * per + min(stage, extra)
    return first, first + per + (stage < extra)


Factory = Callable[[ModelConfig], torch.nn.Module]
BUILT_IN = ("trainpipe.trainer.model:gpt", "trainpipe.trainer.hf:causal_lm")
_SPEC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")  # as model.factory's


def model_factory(fn: Factory) -> Factory:
    """Mark ``fn`` as a model factory that ``model.factory`` may name."""
    setattr(fn, MARK, True)
    return fn


def load_factory(spec: str) -> Factory:
    """The factory ``package.module:function`` names; ProfileError saying what is wrong with it otherwise."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ProfileError(
            f"model.factory {spec}: cannot import {module_name} ({exc}); install it or put it on PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ProfileError(f"model.factory {spec}: {module_name} has no {attr}")
    if not callable(fn) or not getattr(fn, MARK, False):
        raise ProfileError(
            f"model.factory {spec} is not a model factory: "
            "decorate it with @model_factory from trainpipe.trainer.factory"
        )
    return cast(Factory, fn)  # marked by @model_factory, which takes a Factory


def recorded_factory_problem(recorded: object, trusted: str | None) -> str | None:
    """Why a ``model.factory`` read from the store may not be imported; None when it may: a built-in one, or
    ``trusted`` (the factory the caller's own profile names). Checked before anything is imported: importing a
    module runs its code, and several standard-library modules act when imported."""
    recorded = current_factory(recorded)
    if not isinstance(recorded, str) or not _SPEC.fullmatch(recorded):
        return "it records a model.factory that is not a 'package.module:function'"
    if recorded in BUILT_IN or recorded == trusted:
        return None
    if trusted is None:
        return f"it names model.factory {recorded}, not a built-in one ({', '.join(BUILT_IN)}), and no profile names it"
    return (
        f"it was trained with model.factory {recorded}, the profile names {trusted}: set model.factory to "
        f"{recorded} in the profile to import that module, if you trust it"
    )


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    """The model ``cfg.factory`` builds; ProfileError (one line, not retried) when it fails or is not a Module."""
    factory = load_factory(cfg.factory)
    try:
        model = factory(cfg)
    except ProfileError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's factory may fail any way; the user needs its reason
        raise ProfileError(f"model.factory {cfg.factory} failed: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    _require_module(cfg, model)
    return model


def check_model(cfg: ModelConfig) -> None:
    """Build the model once on the meta device (no memory, no weights): a factory that cannot be imported, is
    not marked, fails or returns no Module is a ProfileError here, before any job starts.

    A factory that fails on the meta device is built once more on the CPU, so one that only cannot run there
    (it reads values of its fresh weights, say) is not refused."""
    load_factory(cfg.factory)
    try:
        with torch.device("meta"):
            model = load_factory(cfg.factory)(cfg)
    except ProfileError:
        raise
    except Exception:  # noqa: BLE001 - a meta-only failure or a real one: building for real tells them apart
        model = build_model(cfg)
    _require_module(cfg, model)


def check_layout(cfg: ModelConfig, layout: Layout, loss_parallel: bool = True) -> None:
    """The model's plan and stages for ``layout`` on the meta device: ProfileError, one line, when the model has
    none or its plan does not fit (``parallel.tp`` not dividing its heads, more stages than layers)."""
    if layout.tp == 1 and layout.pp == 1:
        return
    with torch.device("meta"):
        model: Any = build_model(cfg)  # its split methods are this protocol's, checked just below
    for size, method, key in ((layout.tp, "tensor_parallel_plan", "tp"), (layout.pp, "pipeline_stage", "pp")):
        if size > 1 and not callable(getattr(model, method, None)):
            raise ProfileError(
                f"parallel.{key}={size}: model.factory {cfg.factory} gives no {method}, so its model cannot be split "
                f"so; set parallel.{key}: 1 or add the method (trainpipe.trainer.factory's protocol)"
            )
    try:
        if layout.tp > 1:
            model.tensor_parallel_plan(layout.tp, loss_parallel)
        if layout.pp > 1:
            model.pipeline_stage(0, layout.pp)
    except ValueError as exc:
        raise ProfileError(f"model.factory {cfg.factory}: {exc}".splitlines()[0]) from None


def _require_module(cfg: ModelConfig, model: object) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ProfileError(f"model.factory {cfg.factory} returned {type(model).__name__}, not a torch.nn.Module")


def model_loss(output: Any, factory: str = "the model") -> torch.Tensor:
    """The loss out of what the protocol lets ``model(inputs, targets)`` return."""
    loss = returned = output  # (``returned``: not narrowed by the checks on ``output``)
    if isinstance(output, tuple | list) and len(output) == 2:
        loss = output[1]
    elif not isinstance(output, torch.Tensor) and hasattr(output, "loss"):
        loss = returned.loss  # a transformers ModelOutput
    if isinstance(loss, DTensor):  # under loss parallelism: a replicated DTensor (differentiable to its value)
        loss = loss.full_tensor()
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ProfileError(
            f"model.factory {factory}: model(inputs, targets) returned {type(output).__name__}, not a scalar loss, "
            "(logits, loss) or an object with .loss"
        )
    return loss.reshape(())
