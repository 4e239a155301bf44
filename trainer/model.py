"""A small GPT (after nanoGPT): enough to learn real text, small enough for CPUs."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.nn import functional as F

from trainpipe.trainer.config import ModelConfig
from trainpipe.trainer.factory import StageSplit, TensorParallelPlan, model_factory, stage_layers


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        # q, k and v apart (not one fused matrix): tensor parallelism splits each by heads
        self.q, self.k, self.v = (nn.Linear(cfg.n_embd, cfg.n_embd) for _ in range(3))
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds n_head / tp of them
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.stage: int | None = None  # a pipeline stage's index once pipeline_stage kept only it
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor:
        x = idx
        if self.wte is not None:  # the first pipeline stage, or the whole model
            assert self.wpe is not None and self.drop is not None  # kept with the token embedding
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:  # another stage's blocks are Identity
            x = block(x)
        if self.head is None:  # a pipeline stage before the last: its activations go on
            return x
        assert self.ln_f is not None  # kept with the head
        logits = self.head(self.ln_f(x))
        if self.stage is not None:  # the last stage: the pipeline's loss function takes the logits
            return logits
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    def tensor_parallel_plan(self, tp: int, loss_parallel: bool) -> TensorParallelPlan:
        """Megatron's split: q, k, v and the first MLP matrix by columns (heads), the projections after them by
        rows; the embedding and the tied head by vocabulary rows, so the logits stay sharded for loss
        parallelism."""
        cfg = self.cfg
        for what, size in (("model.n_head", cfg.n_head), ("model.n_embd", cfg.n_embd)):
            if size % tp:
                raise ValueError(f"parallel.tp={tp} does not divide {what}={size}")
        loss_parallel = loss_parallel and cfg.vocab_size % tp == 0
        styles = {
            "blocks.*.attn.q": ColwiseParallel(),
            "blocks.*.attn.k": ColwiseParallel(),
            "blocks.*.attn.v": ColwiseParallel(),
            "blocks.*.attn.proj": RowwiseParallel(),
            "blocks.*.mlp.0": ColwiseParallel(),
            "blocks.*.mlp.2": RowwiseParallel(),
        }
        if loss_parallel:
            styles["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            styles["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return TensorParallelPlan(styles, loss_parallel=loss_parallel, tied=[("wte.weight", "head.weight")])

    def pipeline_stage(self, stage: int, stages: int) -> StageSplit:
        """Keep only pipeline stage ``stage`` of ``stages`` (in place): its blocks (others become Identity, so
        names stay the whole model's), the embeddings on the first, the final norm and head on the last."""
        first, last = stage_layers(len(self.blocks), stage, stages)
        for i in range(len(self.blocks)):
            if not first <= i < last:
                self.blocks[i] = nn.Identity()
        if stage > 0:
            self.wte = self.wpe = self.drop = None
        if stage < stages - 1:
            self.ln_f = self.head = None
        self.stage = stage
        return StageSplit(tied=[("wte.weight", "head.weight")] if stages > 1 else [])

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@model_factory
def gpt(cfg: ModelConfig) -> GPT:
    """The built-in GPT (``model.factory: trainpipe.trainer.model:gpt``): n_layer, n_head, n_embd, dropout."""
    return GPT(cfg)


def model_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over tensors (names sorted, dtype, shape, bytes): equal digests mean equal weights."""
    return streamed_digest((name, state_dict[name]) for name in sorted(state_dict))


def streamed_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """``model_digest`` of tensors given one at a time, in name order: a model that is never whole has one."""
    h = hashlib.sha256()
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def flops_per_token(model: torch.nn.Module, layers: int, width: int, context: int) -> float:
    """Training FLOPs per token, as nanoGPT and PaLM count them: 6 per parameter (forward and backward) plus
    attention's 12 × layers × width × context. A transformers model's own config gives its layers and width."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", layers)
    width = getattr(config, "hidden_size", width)
    params = sum(p.numel() for p in model.parameters())
    return 6.0 * params + 12.0 * layers * width * context
