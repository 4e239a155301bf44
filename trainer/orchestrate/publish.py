"""The publish stage's work (docs/architecture.md §11): a validated checkpoint becomes a registered model.

1. Export the checkpoint to a Hugging Face folder (``trainer.export``), checked bit for bit, and recompute its
   state hash from every record of its files: it must be the one its proof records.
2. Evaluate the exported model, loaded by stock transformers, on the run's validation windows: the same loss
   validation measured with trainpipe's forward, or the export is refused.
3. The gate: the registry's ``champion`` is downloaded and evaluated on the same windows (recomputed here,
   never read from a tag); the new version becomes champion when its loss is no worse (within
   ``publish.gate_tolerance``), or at most ``publish.gate_max_val_loss``.
4. Log the model to the run through ``mlflow.transformers`` (a text-generation pipeline: what
   ``mlflow.pyfunc.load_model`` serves), with pinned requirements and an input example; the validation loss
   and the run's datasets are linked to it.
5. Register a version tagged with its lineage; alias ``candidate``, and ``champion`` when the gate passed.

A run that publishes the same weights again (a retried task, a finished run started again) finds its version
and does not register another.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from trainpipe.trainer.checkpoint.catalog import MANIFEST_MAX_BYTES
from trainpipe.trainer.checkpoint.files import read_file
from trainpipe.trainer.checkpoint.validate import EVAL_BATCH, EVAL_WINDOWS
from trainpipe.trainer.config import Profile
from trainpipe.trainer.data.tokens import TokenStream
from trainpipe.trainer.errors import ExportError, PublishError
from trainpipe.trainer.evaluation import eval_windows, mean_loss
from trainpipe.trainer.export.folder import ExportReport, export_checkpoint
from trainpipe.trainer.orchestrate.registry import (
    CANDIDATE,
    CHAMPION,
    TAG,
    Registry,
    code_version,
    fluent,
    lineage_tags,
)
from trainpipe.trainer.store import filesystem
from trainpipe.trainer.store_paths import DATASET_MANIFEST, dataset_uri

if TYPE_CHECKING:  # transformers loads only where a model is published
    from transformers import PreTrainedModel

# The export's loss and validation's (trainpipe's forward) differ only in the order of float32 sums.
SAME_LOSS = 1e-4
PINNED = ("torch", "transformers", "tokenizers", "safetensors", "mlflow")


@dataclass(frozen=True)
class GateDecision:
    """Whether the new version became champion, on which figures, said in one line."""

    promoted: bool
    candidate_val_loss: float
    champion_version: str | None = None
    champion_val_loss: float | None = None
    line: str = ""


@dataclass(frozen=True)
class Published:
    """What the publish stage registered."""

    registered_model: str
    version: str
    aliases: list[str]
    model_uri: str  # models:/NAME/VERSION
    model_id: str
    gate: GateDecision
    files: dict[str, str] = field(default_factory=dict)  # name → sha256 of the exported files
    reused: bool = False  # this run had published these weights already

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def publish_checkpoint(
    profile: Profile, run_name: str, run_id: str | None, validated: dict[str, Any], work: Path
) -> Published:
    """Export, evaluate, gate, log and register the validated checkpoint ``validated["uri"]`` of run
    ``run_name`` (MLflow run ``run_id``); ``work``: an empty private folder for the export and the champion."""
    if run_id is None or not profile.tracking.enabled:
        raise PublishError("publishing needs MLflow tracking: set tracking.enabled: true, or publish.enabled: false")
    name = profile.publish.name_for(profile.tracking.experiment)
    registry = Registry(profile.tracking.tracking_uri)
    registry.ensure_model(name)  # a name it refuses, a registry that is away: said before any work
    existing = registry.version_of(name, run_id, validated["model_digest"])
    if existing is not None and f"{TAG}gate" in existing.tags:  # a search's versions carry no aliases
        return _published(registry, name, registry.version(name, str(existing.version)), reused=True)
    export = export_checkpoint(validated["uri"], work / "model", profile, check_state=True)
    so = profile.store.storage_options
    lm = load_stock(work / "model")
    candidate = stock_val_loss(lm, export.dataset_uri, export.block_size, so)
    if not math.isclose(candidate, validated["val_loss"], abs_tol=SAME_LOSS):
        raise ExportError(
            f"the exported model's val loss {candidate:.6f} is not the checkpoint's {validated['val_loss']:.6f}: the "
            f"export does not reproduce trainpipe's forward; nothing was published"
        )
    evaluated = Evaluated(candidate, work / "model" / "tokenizer.json", export.dataset_uri, export.block_size)
    gate = decide_gate(registry, name, profile, evaluated, work)
    if existing is None:
        model_id = log_model(profile, run_name, run_id, lm, work / "model", export, candidate)
        tags = lineage_tags(
            run=run_name,
            model_id=model_id,
            dataset_id=export.dataset_uri.rstrip("/").rsplit("/", 1)[-1],
            checkpoint=profile.hide(export.uri),
            step=str(export.step),
            block_size=str(export.block_size),
            model_digest=export.model_digest,
            state_hash=export.state_hash,  # recomputed from every record the export read
            val_loss=f"{candidate:.6f}",
            code_version=code_version(),
            files=export.files,
        )
        existing = registry.register(name, run_id, model_id, tags)
    version = str(existing.version)
    registry.move_alias(name, CANDIDATE, version)
    if gate.promoted:
        registry.move_alias(name, CHAMPION, version)
    figures = {"candidate_val_loss": f"{gate.candidate_val_loss:.6f}"}
    if gate.champion_version is not None:
        figures["champion_version"] = gate.champion_version
    if gate.champion_val_loss is not None:
        figures["champion_val_loss"] = f"{gate.champion_val_loss:.6f}"
    registry.tag(name, version, lineage_tags(**figures, gate=gate.line))  # the gate tag last: published
    return _published(registry, name, registry.version(name, version), gate=gate, files=export.files)


def _published(
    registry: Registry,
    name: str,
    v: Any,
    reused: bool = False,
    gate: GateDecision | None = None,
    files: dict[str, str] | None = None,
) -> Published:
    tags = v.tags
    if gate is None:  # as recorded when this run published it
        loss = float(tags.get(f"{TAG}candidate_val_loss", "nan"))
        champion = tags.get(f"{TAG}champion_val_loss")
        gate = GateDecision(
            promoted=CHAMPION in (getattr(v, "aliases", None) or []),
            candidate_val_loss=loss,
            champion_version=tags.get(f"{TAG}champion_version"),
            champion_val_loss=float(champion) if champion else None,
            line=tags.get(f"{TAG}gate", ""),
        )
    return Published(
        registered_model=name,
        version=str(v.version),
        aliases=sorted(getattr(v, "aliases", None) or []),
        model_uri=f"models:/{name}/{v.version}",
        model_id=str(getattr(v, "model_id", None) or v.tags.get(f"{TAG}model_id", "")),
        gate=gate,
        files=files if files is not None else json.loads(tags.get(f"{TAG}files", "{}")),
        reused=reused,
    )


def load_stock(folder: Path) -> PreTrainedModel:
    """A Hugging Face folder's causal LM, as any user loads it: safetensors only, no remote code."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(folder), use_safetensors=True, trust_remote_code=False).eval()
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a folder it cannot load
        first = (str(exc).splitlines() or [""])[0][:300]
        raise ExportError(f"the model folder {folder.name} does not load in transformers ({first})") from None


class _Protocol(torch.nn.Module):
    """A stock causal LM under trainpipe's ``(inputs, targets) -> (logits, loss)``: targets are already shifted."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm(input_ids=inputs, use_cache=False).logits
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def stock_val_loss(lm: torch.nn.Module, dataset_uri: str, block: int, storage_options: dict[str, Any]) -> float:
    """The mean loss of ``lm`` over validation's windows of the dataset (``checkpoint.validate``'s)."""
    val = TokenStream(dataset_uri, "val", storage_options)
    return mean_loss(_Protocol(lm), val, eval_windows(val, block, EVAL_WINDOWS), block, EVAL_BATCH)


@dataclass(frozen=True)
class Evaluated:
    """A model the gate weighs: its val loss, the tokenizer.json its ids come from, and the data and window length
    the loss was measured on."""

    val_loss: float
    tokenizer: Path
    dataset_uri: str
    block_size: int


def decide_gate(registry: Registry, name: str, profile: Profile, candidate: Evaluated, work: Path) -> GateDecision:
    """Whether ``candidate`` may become champion: its loss against the champion's, both computed here on the same
    validation windows; or the profile's own threshold."""
    cfg, loss = profile.publish, candidate.val_loss
    threshold = cfg.gate_max_val_loss is not None and loss <= cfg.gate_max_val_loss
    by_threshold = f"; at most publish.gate_max_val_loss {cfg.gate_max_val_loss}" if threshold else ""
    champion = registry.by_alias(name, CHAMPION)
    if champion is None:
        return GateDecision(True, loss, line=f"promoted: no champion yet (val loss {loss:.4f})")
    theirs = f"champion v{champion.version}"
    folder = _download(registry, champion, work / "champion")
    problem = _incomparable(folder, candidate.tokenizer, candidate.block_size)
    if problem:
        line = f"{theirs} {problem}: val losses do not compare{by_threshold}"
        return GateDecision(
            threshold, loss, str(champion.version), None, ("promoted: " if threshold else "kept: ") + line
        )
    lm = load_stock(folder / "model")
    champion_loss = stock_val_loss(lm, candidate.dataset_uri, candidate.block_size, profile.store.storage_options)
    better = loss <= champion_loss + cfg.gate_tolerance
    line = (
        f"{'promoted' if better or threshold else 'kept'}: val loss {loss:.4f} against {theirs}'s "
        f"{champion_loss:.4f}, both on dataset {candidate.dataset_uri.rstrip('/').rsplit('/', 1)[-1]}"
        + (f" (tolerance {cfg.gate_tolerance})" if cfg.gate_tolerance else "")
        + ("" if better else by_threshold)
    )
    return GateDecision(better or threshold, loss, str(champion.version), champion_loss, line)


def promote_version(profile: Profile, version: str, force: bool, work: Path) -> GateDecision:
    """``trainpipe models promote``: move ``champion`` to ``version`` of the profile's registered model when the
    gate passes, its loss and the champion's recomputed here on the version's own dataset (or by hand with
    ``force``, said so on the version). PublishError, in one line, when it does not."""
    name = profile.publish.name_for(profile.tracking.experiment)
    registry = Registry(profile.tracking.tracking_uri)
    chosen = registry.version(name, version)
    dataset_id = chosen.tags.get(f"{TAG}dataset_id", "")
    block = chosen.tags.get(f"{TAG}block_size", "")
    if not re.fullmatch(r"[0-9a-f]{16}", dataset_id) or not block.isdigit():
        raise PublishError(f"{name} version {version} was not published by trainpipe (no dataset or block size tag)")
    if force:
        gate = GateDecision(True, float("nan"), line="promoted by hand (trainpipe models promote --force)")
    else:
        folder = _download(registry, chosen, work / "candidate")
        uri = dataset_uri(profile.store.root, dataset_id)
        loss = stock_val_loss(load_stock(folder / "model"), uri, int(block), profile.store.storage_options)
        tokenizer = folder / "components" / "tokenizer" / "tokenizer.json"
        gate = decide_gate(registry, name, profile, Evaluated(loss, tokenizer, uri, int(block)), work)
        if gate.champion_version == str(chosen.version):
            return gate
    if gate.promoted:
        registry.move_alias(name, CHAMPION, str(chosen.version))
        registry.tag(name, str(chosen.version), lineage_tags(gate=gate.line))
    return gate


def _download(registry: Registry, version: Any, into: Path) -> Path:
    """The files of a registered version, from its logged model's artifact location (a plain store URI: no
    ``models:/`` lookup through mlflow's process-wide state)."""
    import mlflow.artifacts

    into.mkdir(parents=True, exist_ok=True)
    model_id = getattr(version, "model_id", None) or version.tags.get(f"{TAG}model_id", "")
    location = registry._call("read the champion's logged model", registry.client.get_logged_model, model_id)
    where = registry._call(
        "download the champion",
        mlflow.artifacts.download_artifacts,
        artifact_uri=location.artifact_location,
        dst_path=str(into),
        tracking_uri=registry.uri,
    )
    return Path(where)


def _incomparable(champion: Path, tokenizer: Path, block: int) -> str | None:
    """Why the champion's losses cannot be compared with the candidate's: another tokenizer (other ids for the
    same text; ``tokenizer``: the candidate's tokenizer.json), or a context shorter than the windows."""
    from tokenizers import Tokenizer

    theirs = champion / "components" / "tokenizer" / "tokenizer.json"
    if not theirs.is_file() or not (champion / "model" / "config.json").is_file():
        return "is not a transformers model trainpipe published"
    a, b = (json.loads(Tokenizer.from_file(str(p)).to_str()) for p in (theirs, tokenizer))
    if a.get("model") != b.get("model") or a.get("pre_tokenizer") != b.get("pre_tokenizer"):
        return "has another tokenizer"
    config = json.loads((champion / "model" / "config.json").read_text())
    context = config.get("n_positions") or config.get("max_position_embeddings") or 0
    if not isinstance(context, int) or context < block:
        return f"has a context of {context} tokens, fewer than the {block} of the windows"
    return None


def log_model(
    profile: Profile,
    run_name: str,
    run_id: str,
    lm: PreTrainedModel,
    folder: Path,
    export: ExportReport,
    val_loss: float,
) -> str:
    """Log ``lm`` (the export at ``folder``) to the run as a transformers text-generation model; its id."""
    import mlflow
    import mlflow.transformers as mlflow_transformers
    import transformers
    from mlflow.entities import DatasetInput, InputTag, LoggedModelInput

    from trainpipe.trainer.tracking import client

    uri = profile.tracking.tracking_uri
    pipe = transformers.pipeline(
        "text-generation", model=lm, tokenizer=transformers.AutoTokenizer.from_pretrained(str(folder))
    )
    try:
        c = client(uri)
        with fluent(uri):
            # Made first in the run's own experiment: log_model would make it in the fluent API's current one
            # (the Default experiment, whose artifacts lie in ./mlruns of whatever folder this runs in).
            logged = mlflow.initialize_logged_model(
                name="model",
                source_run_id=run_id,
                experiment_id=c.get_run(run_id).info.experiment_id,
                tags={"trainpipe.model_digest": export.model_digest},
            )
            info = mlflow_transformers.log_model(
                transformers_model=pipe,
                name="model",
                task="text-generation",
                model_card=model_card(profile, run_name, export, val_loss),
                input_example=[profile.publish.prompt],
                pip_requirements=pins(),
                step=export.step,
                run_id=run_id,
                model_id=logged.model_id,
            )
        c.log_metric(run_id, "validated/val_loss", val_loss, step=export.step, model_id=info.model_id)
        inputs = [
            DatasetInput(dataset_entity(export, profile, split), tags=[InputTag("mlflow.data.context", context)])
            for split, context in (("train", "training"), ("val", "validation"))
        ]
        c.log_inputs(run_id, datasets=inputs, models=[LoggedModelInput(info.model_id)])
    except Exception as exc:  # noqa: BLE001 - MLflow's and transformers' errors: one line, credentials hidden
        first = profile.hide((str(exc).splitlines() or [""])[0][:300])
        raise PublishError(f"MLflow refused the model of run {run_id}: {type(exc).__name__}: {first}") from None
    return info.model_id


def model_card(profile: Profile, run_name: str, export: ExportReport, val_loss: float) -> Any:
    """The model's card (its README.md in the logged model): what trained it, on what, and how it validated.
    Given, so that MLflow does not look a local folder up on the Hugging Face Hub as a repository (a warning on
    every publish, and a network call on an air-gapped cluster). No license is declared: the model is the
    user's, and MLflow's LICENSE.txt says so."""
    from huggingface_hub import ModelCard

    lines = [
        f"# {profile.publish.name_for(profile.tracking.experiment)}: run {run_name}",
        "",
        f"A {export.model_type} language model trained by trainpipe: step {export.step}, validation loss "
        f"{val_loss:.4f} over windows of {export.block_size} tokens, tokenizer {export.tokenizer}.",
        "",
        f"- dataset: `{export.dataset_uri.rstrip('/').rsplit('/', 1)[-1]}`",
        f"- weights digest: `{export.model_digest}`",
    ]
    return ModelCard(profile.hide("\n".join(lines) + "\n"))  # a credential's value is hidden wherever it lands


def dataset_entity(export: ExportReport, profile: Profile, split: str) -> Any:
    """One split of the run's dataset as an MLflow dataset: the dataset's id and split, where it lies, the digest
    of its manifest (which lists every shard's sha256) and the tokenizer."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    fs, base = filesystem(export.dataset_uri, profile.store.storage_options)
    manifest = read_file(fs, base, DATASET_MANIFEST, limit=MANIFEST_MAX_BYTES, kind="dataset manifest")
    dataset_id = export.dataset_uri.rstrip("/").rsplit("/", 1)[-1]
    with warnings.catch_warnings():  # a local path "can be interpreted" as two kinds of the same local source
        warnings.simplefilter("ignore", UserWarning)
        source = resolve_dataset_source(profile.hide(export.dataset_uri))
    name = f"{dataset_id}/{split} ({export.tokenizer} tokenizer)"
    return MetaDataset(source, name=name, digest=hashlib.sha256(manifest).hexdigest()[:16])._to_mlflow_entity()


def pins() -> list[str]:
    """The logged model's requirements: this environment's versions of what loading it imports."""
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in PINNED]
