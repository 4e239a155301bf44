"""Pipeline parallelism (``parallel.pp``): this rank's stage of the model under a torch.distributed.pipelining
schedule (docs/architecture.md §10).

A step's samples on a data-parallel rank are the pipeline's micro-batches (``train.micro_batch`` each); the
schedule (GPipe or 1F1B) runs their forwards and backwards over the stages, scales the gradients to the mean of
the micro-batches' losses, and lets FSDP2 reduce them at the last backward. The last stage's cross-entropy over
its logits is the loss. Parameters the first and last stages both hold (a tied embedding and head) have their
gradients summed over the two, so they stay equal.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn import functional as F

from trainpipe.trainer.loop.mesh import Mesh

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss: the mean cross-entropy of its logits (sharded over the vocabulary under loss
    parallelism) against the targets."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under loss parallelism it is a replicated DTensor)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _renamed_state(optim: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """An optimizer state dict with its parameters renamed by ``names``: flattened (``state.{param}.{field}``,
    ``param_groups.{param}.{field}``) or nested (``state[param]``, each group's ``params`` list)."""
    if not names:
        return optim
    if isinstance(optim.get("state"), dict) and isinstance(optim.get("param_groups"), list):
        groups = [{**g, "params": [names.get(p, p) for p in g["params"]]} for g in optim["param_groups"]]
        return {**optim, "state": {names.get(k, k): v for k, v in optim["state"].items()}, "param_groups": groups}
    out = {}
    for key, value in optim.items():
        for old, new in names.items():
            for kind in ("state.", "param_groups."):
                if key.startswith(f"{kind}{old}."):
                    key = f"{kind}{new}.{key.removeprefix(f'{kind}{old}.')}"
        out[key] = value
    return out


class Pipeline:
    """This rank's stage and the schedule that runs it with the other stages of its replica."""

    def __init__(
        self,
        stage_module: torch.nn.Module,
        mesh: Mesh,
        device: torch.device,
        schedule: str,
        microbatches: int,
        sharded_loss: bool,
        tied: list[tuple[str, str]],
    ):
        self.mesh, self.sharded_loss = mesh, sharded_loss
        layout = mesh.layout
        self.stage = PipelineStage(stage_module, mesh.stage, layout.pp, device, group=mesh.pp_group())
        self.schedule = SCHEDULES[schedule](self.stage, microbatches, loss_fn=cross_entropy)
        self.microbatches = microbatches
        held = dict(stage_module.named_parameters(remove_duplicate=False))
        # The first stage's tied parameter and the last stage's copy: summed over the pair, counted once (first).
        self.tied = [held[a] if mesh.first_stage else held[b] for a, b in tied if a in held or b in held]
        copy_end = mesh.last_stage and not mesh.first_stage
        self.copies = {id(p) for p in self.tied} if copy_end else set()
        self.copy_names = frozenset(b for _, b in tied if b in held) if copy_end else frozenset()
        self.pair = mesh.end_stages_group() if tied else None
        self.renames = {b: a for a, b in tied if b in self.copy_names}  # copy's name -> the whole model's
        self.whole_names = frozenset(self.renames.values())  # what the copies' state goes under in a checkpoint

    def whole_model_names(self, optim: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state dict (flattened, or torch's nested one) with this stage's copies of tied parameters
        under the names the whole model gives them (the first stage's), as a checkpoint of any layout holds them."""
        return _renamed_state(optim, self.renames)

    def stage_names(self, optim: dict[str, Any]) -> dict[str, Any]:
        """``whole_model_names`` undone: the names this stage's optimizer knows."""
        return _renamed_state(optim, {b: a for a, b in self.renames.items()})

    def context(self) -> contextlib.AbstractContextManager:
        """Around a forward and backward: loss parallelism when the logits are sharded."""
        return loss_parallel() if self.sharded_loss else contextlib.nullcontext()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool = True) -> torch.Tensor:
        """One pass of the schedule over a data-parallel rank's batch (``train``: forward and backward, else
        forward only); the mean loss of its micro-batches on the last stage, zero elsewhere."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.mesh.first_stage else ()
        target = targets if self.mesh.last_stage else None
        with self.context():
            run = self.schedule.step if train else self.schedule.eval
            # the losses only: the last stage keeps no micro-batch's logits (1F1B's memory bound holds)
            run(*args, target=target, losses=losses if self.mesh.last_stage else None, return_outputs=False)
        if not self.mesh.last_stage:
            return torch.zeros((), device=inputs.device)
        return torch.stack([local_value(x).detach().float() for x in losses]).mean()

    def sum_tied(self) -> None:
        """The gradients of the parameters both end stages hold, summed over the two (after the backward)."""
        if self.pair is None:
            return
        for p in self.tied:
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=self.pair)
