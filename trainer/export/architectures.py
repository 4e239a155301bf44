"""Which stock transformers architecture a trainpipe model is, and where each of its weights goes there: a
registry of export specs by model factory, as torchtitan keeps train specs (docs/architecture.md §11).

- ``trainpipe.trainer.model:gpt`` → ``GPT2LMHeadModel``: GPT-2's shapes and forward (pre-norm blocks, learned
  positions, exact GELU, biases, a head tied to the embedding). q, k and v sit side by side in GPT-2's fused
  ``c_attn``; its ``Conv1D`` matrices are a ``Linear``'s transposed.
- ``trainpipe.trainer.hf:causal_lm`` → the transformers model it already is, its config as built: names lose
  the wrapper's ``lm.``; a weight the model ties to another is left out, as ``save_pretrained`` leaves it.

Another factory has no stock equivalent: ``export_spec`` says so in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainpipe.trainer.config import GPT_FACTORY, ModelConfig
from trainpipe.trainer.errors import ExportError
from trainpipe.trainer.export.safetensors_out import TensorSpec
from trainpipe.trainer.factory import build_model

CAUSAL_LM_FACTORY = "trainpipe.trainer.hf:causal_lm"


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint weight goes in the export: tensor ``target``, transposed (a 2-D weight) or not, from
    index ``column`` of the target's last dimension on. ``tied``: not written, it must equal the target's
    bytes (a head tied to the embedding)."""

    target: str
    transpose: bool = False
    column: int = 0
    tied: bool = False

    def place(self, block: torch.Tensor, at: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """A block of the checkpoint weight at ``at``, as the block of the target it becomes, and where."""
        if self.transpose:
            block, at = block.t(), at[::-1]
        return block, (*at[:-1], at[-1] + self.column) if at else at

    def take(self, target: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The checkpoint weight of ``shape`` back out of the whole ``target``: the inverse of ``place``."""
        width = shape[0] if self.transpose else shape[-1]
        part = target[..., self.column : self.column + width]
        return part.t() if self.transpose else part


@dataclass(frozen=True)
class HFModel:
    """A trainpipe model as a stock transformers model: its config, its tensors and where each weight goes."""

    config: Any  # a transformers PretrainedConfig
    tensors: dict[str, TensorSpec]
    placements: dict[str, Placement] = field(default_factory=dict)


ExportSpec = Callable[[ModelConfig, dict[str, TensorSpec]], HFModel]
_SPECS: dict[str, ExportSpec] = {}


def register_export(factory: str) -> Callable[[ExportSpec], ExportSpec]:
    def add(fn: ExportSpec) -> ExportSpec:
        _SPECS[factory] = fn
        return fn

    return add


def export_spec(model: ModelConfig, weights: dict[str, TensorSpec]) -> HFModel:
    """The stock transformers form of the model ``model`` describes, whose checkpoint holds ``weights``."""
    spec = _SPECS.get(model.factory)
    if spec is None:
        raise ExportError(
            f"model.factory {model.factory} has no stock transformers equivalent to export to (trainpipe exports "
            f"{' and '.join(sorted(_SPECS))}); the checkpoint stays as it is"
        )
    hf = spec(model, weights)
    unplaced = sorted(set(weights) - set(hf.placements))
    if unplaced:
        raise ExportError(f"the checkpoint's weight {unplaced[0]} has no place in the {hf.config.model_type} export")
    return hf


@register_export(GPT_FACTORY)
def gpt2(model: ModelConfig, weights: dict[str, TensorSpec]) -> HFModel:
    from transformers import GPT2Config

    n, dtype = model.n_embd, weights["wte.weight"].dtype
    config = GPT2Config(
        vocab_size=model.vocab_size,
        n_positions=model.block_size,
        n_embd=n,
        n_layer=model.n_layer,
        n_head=model.n_head,
        n_inner=4 * n,
        activation_function="gelu",  # torch.nn.GELU(): exact, not GPT-2's tanh approximation
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,  # torch.nn.LayerNorm's
        tie_word_embeddings=True,
        bos_token_id=None,  # the run's end-of-text, which the export sets from its tokenizer
        eos_token_id=None,
        dtype=str(dtype).removeprefix("torch."),
    )
    place = {
        "wte.weight": Placement("transformer.wte.weight"),
        "head.weight": Placement("transformer.wte.weight", tied=True),
        "wpe.weight": Placement("transformer.wpe.weight"),
        "ln_f.weight": Placement("transformer.ln_f.weight"),
        "ln_f.bias": Placement("transformer.ln_f.bias"),
    }
    for i in range(model.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            place |= {f"{ours}{a}.{p}": Placement(f"{theirs}{b}.{p}") for p in ("weight", "bias")}
        for j, proj in enumerate("qkv"):
            place[f"{ours}attn.{proj}.weight"] = Placement(f"{theirs}attn.c_attn.weight", True, j * n)
            place[f"{ours}attn.{proj}.bias"] = Placement(f"{theirs}attn.c_attn.bias", column=j * n)
        for a, b in (("attn.proj", "attn.c_proj"), ("mlp.0", "mlp.c_fc"), ("mlp.2", "mlp.c_proj")):
            place[f"{ours}{a}.weight"] = Placement(f"{theirs}{b}.weight", transpose=True)
            place[f"{ours}{a}.bias"] = Placement(f"{theirs}{b}.bias")
    return HFModel(config, _target_specs(weights, place), place)


@register_export(CAUSAL_LM_FACTORY)
def transformers_model(model: ModelConfig, weights: dict[str, TensorSpec]) -> HFModel:
    with torch.device("meta"):  # the config as training built it, and which weights it ties; nothing allocated
        lm: Any = build_model(model).lm  # trainer.hf.CausalLM's transformers model
    kept = {name for name, _ in lm.named_parameters()} | {name for name, _ in lm.named_buffers() if name in weights}
    place = {}
    for name in weights:
        inner = name.removeprefix("lm.")
        place[name] = Placement(inner) if inner in kept else Placement(_tied_to(lm, inner), tied=True)
    lm.config.use_cache = True  # off for training; generation wants it
    return HFModel(lm.config, _target_specs(weights, place), place)


def _tied_to(lm: Any, name: str) -> str:
    """The parameter ``name`` is the same tensor as: the name ``named_parameters`` keeps for it."""
    params = dict(lm.named_parameters(remove_duplicate=False))
    if name not in params:
        raise ExportError(f"the checkpoint's weight lm.{name} is not one of the {lm.config.model_type} model's")
    kept = {id(p): n for n, p in lm.named_parameters()}
    return kept[id(params[name])]


def _target_specs(weights: dict[str, TensorSpec], place: dict[str, Placement]) -> dict[str, TensorSpec]:
    """Each target's dtype and shape, from the weights placed in it: their extents, transposed where placed so."""
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for name, p in place.items():
        spec = weights.get(name)
        if spec is None:
            raise ExportError(f"the checkpoint has no weight {name}, which the export needs")
        if p.tied:
            continue
        shape = list(spec.shape[::-1] if p.transpose else spec.shape)
        if shape:
            shape[-1] += p.column
        have = shapes.setdefault(p.target, shape)
        if have[:-1] != shape[:-1] or dtypes.setdefault(p.target, spec.dtype) != spec.dtype:
            raise ExportError(f"the checkpoint's weights placed in {p.target} do not line up")
        if shape:
            have[-1] = max(have[-1], shape[-1])
    return {t: TensorSpec(dtypes[t], tuple(s)) for t, s in shapes.items()}
