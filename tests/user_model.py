"""A user's own model, as a plug-in names it: ``model.factory: tests.user_model:bigram``."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from trainpipe.trainer.config import ModelConfig
from trainpipe.trainer.factory import model_factory


class Bigram(torch.nn.Module):
    """Next token from the current one through a small bottleneck; returns the bare loss (the protocol allows it)."""

    def __init__(self, vocab_size: int, width: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, width)
        self.out = torch.nn.Linear(width, vocab_size)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.out(torch.tanh(self.embed(inputs)))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@model_factory
def bigram(cfg: ModelConfig) -> Bigram:
    return Bigram(cfg.vocab_size, int(cfg.config.get("width", 32)))


@model_factory
def broken(cfg: ModelConfig) -> torch.nn.Module:
    raise ValueError("width must be even")


@model_factory
def not_a_module(cfg: ModelConfig) -> object:
    return {"weights": []}


def unmarked(cfg: ModelConfig) -> Bigram:
    return Bigram(cfg.vocab_size, 8)


@model_factory
def reads_its_weights(cfg: ModelConfig) -> Bigram:
    """Fine on the CPU, fails on the meta device (a meta tensor has no value to read)."""
    model = Bigram(cfg.vocab_size, 8)
    if not torch.isfinite(model.out.weight.sum()).item():
        raise ValueError("non-finite initial weights")
    return model
