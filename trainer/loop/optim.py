"""AdamW with decoupled weight decay on matrices only, and linear warm-up into cosine decay."""

from __future__ import annotations

import math

import torch

from trainpipe.trainer.config import TrainConfig


def build_optimizer(model: torch.nn.Module, t: TrainConfig, meshes: int = 1) -> torch.optim.Optimizer:
    """``meshes``: how many DeviceMeshes the parameters are DTensors of; a foreach kernel takes one mesh's, so
    with more than one each parameter steps on its own."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=t.betas)
    set_kernels(optimizer, meshes)
    return optimizer


def set_kernels(optimizer: torch.optim.Optimizer, meshes: int) -> None:
    """The optimizer's kernels for parameters of ``meshes`` meshes: foreach (the default) for one, per parameter
    for more. Again after a load: a checkpoint of another layout brings its own choice in its param groups."""
    for group in optimizer.param_groups:
        group["foreach"] = False if meshes > 1 else None


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
