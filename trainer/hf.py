"""``model.factory: trainpipe.trainer.hf:causal_lm``: a transformers causal LM built from a config in the profile.

``model.config`` is the model's transformers config: ``model_type`` (``llama``, ``gpt2``, …) and its fields,
e.g. ``{model_type: llama, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
intermediate_size: 128}``. The model is built with ``from_config``: fresh weights from the run's seed, never a
download. ``vocab_size`` is the profile's ``model.vocab_size`` (the tokenizer's) and the position table holds at
least ``model.block_size`` tokens.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from trainpipe.trainer.config import ModelConfig
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.factory import model_factory

_POSITIONS = ("max_position_embeddings", "n_positions")  # what llama-like and gpt2-like configs call it


class CausalLM(torch.nn.Module):
    """The transformers model under trainpipe's protocol: ``(inputs, targets) -> (logits, loss)``."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.lm(input_ids=inputs, use_cache=False).logits
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


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
