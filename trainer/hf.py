"""``model.factory: trainpipe.trainer.hf:causal_lm``: a transformers causal LM built from a config in the profile.

``model.config`` is the model's transformers config: ``model_type`` (``llama``, ``gpt2``, …) and its fields,
e.g. ``{model_type: llama, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
intermediate_size: 128}``. The model is built with ``from_config``: fresh weights from the run's seed, never a
download. ``vocab_size`` is the profile's ``model.vocab_size`` (the tokenizer's) and the position table holds at
least ``model.block_size`` tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.nn import functional as F

from trainpipe.trainer.config import ModelConfig
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.factory import StageSplit, TensorParallelPlan, model_factory, stage_layers

_POSITIONS = ("max_position_embeddings", "n_positions")  # what llama-like and gpt2-like configs call it


class CausalLM(torch.nn.Module):
    """The transformers model under trainpipe's protocol: ``(inputs, targets) -> (logits, loss)``; under
    ``parallel`` layouts, split by the config's own tensor-parallel plan and by its layers."""

    # A transformers PreTrainedModel: its submodules (model.layers, lm_head) and config fields are its model type's,
    # which no static type names.
    lm: Any

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        self.stage: int | None = None  # a pipeline stage's index once pipeline_stage kept only it

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor:
        if self.stage is not None:
            return self._stage_forward(inputs)
        logits = self.lm(input_ids=inputs, use_cache=False).logits
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def tensor_parallel_plan(self, tp: int, loss_parallel: bool) -> TensorParallelPlan:
        """The config's own ``base_model_tp_plan`` (colwise and rowwise matrices of each layer); the embedding and
        the head split by vocabulary rows for loss parallelism."""
        config = self.lm.config
        plan = getattr(config, "base_model_tp_plan", None) or {}
        if not plan:
            raise ValueError(f"the transformers {config.model_type} config has no tensor-parallel plan")
        if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
            raise ValueError("model.config.base_model_tp_plan is not a mapping of module names to style names")
        for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size"):
            size = getattr(config, key, None)
            if isinstance(size, int) and size % tp:
                raise ValueError(f"parallel.tp={tp} does not divide model.config.{key}={size}")
        styles = {}
        for name, kind in plan.items():
            if kind not in _STYLES:
                raise ValueError(f"the {config.model_type} plan splits {name} as {kind!r}, which trainpipe does not do")
            styles[f"lm.model.{name}"] = _STYLES[kind]()
        if (getattr(config, "attention_dropout", 0) or 0) > 0:
            raise ValueError("model.config.attention_dropout with parallel.tp: the tp ranks would draw the same masks")
        loss_parallel = loss_parallel and config.vocab_size % tp == 0
        if loss_parallel:
            styles["lm.model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            styles["lm.lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return TensorParallelPlan(styles, loss_parallel=loss_parallel, tied=self._tied())

    def pipeline_stage(self, stage: int, stages: int) -> StageSplit:
        """Keep only pipeline stage ``stage`` of ``stages`` (in place): its decoder layers (others become
        Identity), the embedding on the first, the final norm and the head on the last. Only a model type whose
        forward ``_stage_forward`` reproduces is split (``PIPELINE_TYPES``): another adds its own steps (embedding
        or logit scales, a sliding window) that a stage would silently leave out."""
        base, model_type = self.lm.model, self.lm.config.model_type
        if model_type not in PIPELINE_TYPES:
            raise ValueError(
                f"the transformers {model_type} model has no pipeline split trainpipe knows "
                f"(it splits {', '.join(sorted(PIPELINE_TYPES))})"
            )
        first, last = stage_layers(len(base.layers), stage, stages)
        for i in range(len(base.layers)):
            if not first <= i < last:
                base.layers[i] = torch.nn.Identity()
        if stage > 0:
            base.embed_tokens = None
        if stage < stages - 1:
            base.norm = self.lm.lm_head = None
        self.stage = stage
        return StageSplit(tied=self._tied() if stages > 1 else [])

    def _tied(self) -> list[tuple[str, str]]:
        return [("lm.model.embed_tokens.weight", "lm.lm_head.weight")] if self.lm.config.tie_word_embeddings else []

    def _stage_forward(self, x: torch.Tensor) -> torch.Tensor:
        """One pipeline stage: the decoder layers' own call, as the transformers model makes it (a causal mask is
        implied: no padding)."""
        base = self.lm.model
        if base.embed_tokens is not None:
            x = base.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        rotary = base.rotary_emb(x, position_ids=positions)
        for layer in base.layers:
            if not isinstance(layer, torch.nn.Identity):
                x = layer(x, attention_mask=None, position_embeddings=rotary, position_ids=positions)
        return x if self.lm.lm_head is None else self.lm.lm_head(base.norm(x))


# Models whose forward _stage_forward reproduces: embedding, decoder layers with rotary positions and a causal
# mask, norm, head (no embedding or logit scales, no sliding window).
PIPELINE_TYPES = frozenset({"llama"})
_STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
}


@model_factory
def causal_lm(cfg: ModelConfig) -> CausalLM:
    try:
        import transformers
    except ImportError:
        raise ProfileError("model.factory trainpipe.trainer.hf:causal_lm needs the transformers package") from None
    settings = dict(cfg.config)
    model_type = settings.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ProfileError("model.config.model_type is missing: name a transformers model type (llama, gpt2, …)")
    if settings.setdefault("vocab_size", cfg.vocab_size) != cfg.vocab_size:
        raise ProfileError(
            f"model.config.vocab_size {settings['vocab_size']} differs from model.vocab_size {cfg.vocab_size} "
            "(the tokenizer's): leave it out of model.config"
        )
    try:
        config = transformers.AutoConfig.for_model(model_type, **settings)
    except (ValueError, KeyError, TypeError) as exc:
        raise ProfileError(f"model.config: not a transformers config ({exc})".splitlines()[0]) from None
    for key in _POSITIONS:
        if hasattr(config, key) and getattr(config, key) < cfg.block_size:
            raise ProfileError(f"model.config.{key} {getattr(config, key)} is below model.block_size {cfg.block_size}")
    config.use_cache = False
    return CausalLM(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
