"""``trainpipe ckpt verify RUN``: what a run's checkpoints prove about it (docs/architecture.md §4).

For each committed checkpoint of the run, oldest first: its files are the ones its manifest hashed; it records a
proof (``proof``); its data position agrees with its step and skips; and its sample ledger, the digest of the
samples every rank consumed through its step across all attempts and world sizes, is the one the sample order
plans for those steps. Each epoch of the order is a permutation of the samples, so a ledger equal to the plan
means each sample of an epoch was used exactly once, none skipped but those a rollback skipped on purpose. The
run's attempt records add whether each resume verified its state hash.

Everything is read from the store, which is not trusted (docs/security.md): the dataset a manifest names is
read only when it is the store's own ``datasets/{id}``, and every figure is bounded before use.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from trainpipe.trainer.checkpoint.catalog import CheckpointInfo, list_checkpoints, read_proof
from trainpipe.trainer.checkpoint.proof import CheckpointProof, Sum
from trainpipe.trainer.data.sampler import DataSkip, data_index
from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.incidents import AttemptRecord
from trainpipe.trainer.store_paths import dataset_uri

DATASET_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# What one ``ckpt verify`` takes on: the sample order is planned at about 2 M samples a second on one core.
MAX_BATCH = 1 << 22
MAX_SAMPLES = 1 << 32
MAX_EPOCHS = 1 << 16


@dataclass
class Checked:
    """One checkpoint's verdict: ``problem`` is empty when everything it records holds."""

    step: int
    uri: str
    problem: str = ""
    samples: int | None = None
    epochs: float | None = None  # how many epochs of the sample order its ledger covers


@dataclass
class ChainReport:
    run: str
    checked: list[Checked] = field(default_factory=list)
    resumes: list[bool] = field(default_factory=list)  # per resumed attempt: whether it verified its state hash

    @property
    def holds(self) -> bool:
        return bool(self.checked) and not any(c.problem for c in self.checked) and all(self.resumes)

    def line(self) -> str:
        """One line: what holds, or the first thing that does not."""
        if not self.checked:
            return f"run {self.run}: no checkpoints to verify"
        bad = [c for c in self.checked if c.problem]
        if bad:
            c, n = bad[0], len(self.checked)
            return f"run {self.run}: checkpoint at step {c.step} fails: {c.problem} ({len(bad)} of {n} fail)"
        last = self.checked[-1]
        steps = f"steps {self.checked[0].step}-{last.step}" if len(self.checked) > 1 else f"step {last.step}"
        resumes = f"{sum(self.resumes)} of {len(self.resumes)} resumes verified their state hash"
        if not all(self.resumes):
            return f"run {self.run}: {len(self.checked)} checkpoint(s) hold ({steps}), but only {resumes}"
        return (
            f"run {self.run}: {len(self.checked)} checkpoint(s) hold ({steps}): files and state hashes recorded, "
            f"the ledger of step {last.step} is the sample order's {last.samples} samples ({last.epochs:.2f} epochs, "
            f"each sample of an epoch once); {resumes}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "holds": self.holds,
            "line": self.line(),
            "checkpoints": [c.__dict__ for c in self.checked],
            "resumes_verified": sum(self.resumes),
            "resumes": len(self.resumes),
        }


def verify_run(
    run: str,
    checkpoints: str,
    store_root: str,
    storage_options: dict[str, Any] | None,
    attempts: list[AttemptRecord],
) -> ChainReport:
    """Verify the committed checkpoints under ``checkpoints`` and the resumes of ``attempts`` (docstring above)."""
    report = ChainReport(run, resumes=[a.resume_verified for a in attempts if a.resume_verified is not None])
    plans = _Plans(store_root, storage_options)
    for info in list_checkpoints(checkpoints, storage_options):
        if info.committed:
            report.checked.append(_check(info, plans))
    return report


def _check(info: CheckpointInfo, plans: _Plans) -> Checked:
    checked = Checked(info.step, info.uri)
    if not info.valid:
        checked.problem = info.reason
        return checked
    proof = read_proof(info.manifest)
    if proof is None:
        checked.problem = "it records no proof (written before checkpoints recorded a state hash and a ledger)"
        return checked
    try:
        checked.problem = _ledger_problem(info, proof, plans, checked)
    except (ValueError, TypeError, AttributeError, ValidationError, TrainpipeError) as exc:
        checked.problem = f"its data position cannot be checked ({_short(str(exc).splitlines()[0], 160)})"
    return checked


class _Plans:
    """The planned ledgers so far, so that each checkpoint adds only its own steps to the one before it."""

    def __init__(self, root: str, so: dict[str, Any] | None):
        self.root, self.so = root, so
        self.samples_in: dict[str, int] = {}
        self.last: tuple[tuple, int, Sum] | None = None  # (what the plan depends on, its last step, its ledger)

    def ledger(self, step: int, skips: list[DataSkip], batch: int, seed: int, n_samples: int) -> Sum:
        from trainpipe.trainer.checkpoint.state_hash import planned_ledger

        key = (tuple(k.model_dump_json() for k in skips), batch, seed, n_samples)
        first, base = 1, Sum()
        if self.last and self.last[0] == key and self.last[1] <= step:
            first, base = self.last[1] + 1, self.last[2]
        total = base + planned_ledger(first, step, skips, batch, seed, n_samples) if first <= step else base
        self.last = (key, step, total)
        return total


def _ledger_problem(info: CheckpointInfo, proof: CheckpointProof, plans: _Plans, checked: Checked) -> str:
    m = info.manifest
    position, profile = m.get("data_position"), m.get("profile")
    if not isinstance(position, dict) or not isinstance(profile, dict):
        raise ValueError("no data_position or profile")
    train, model = profile.get("train"), profile.get("model")
    if not isinstance(train, dict) or not isinstance(model, dict):
        raise ValueError("its profile has no train or model section")
    batch = _bounded(train.get("global_batch"), "global_batch", high=MAX_BATCH)
    block = _bounded(model.get("block_size"), "block_size", high=1 << 31)
    seed = _bounded(position.get("seed"), "seed", low=0, high=1 << 63)
    raw_skips = position.get("skips") or []
    if not isinstance(raw_skips, list) or len(raw_skips) > 64:
        raise ValueError("its skips are not a list of at most 64")
    skips = [DataSkip.model_validate(k) for k in raw_skips]
    if position.get("next_step") != info.step:
        return f"its data position is at step {_short(repr(position.get('next_step')))}, not {info.step}"
    if position.get("samples_consumed") != data_index(info.step + 1, skips) * batch:
        return "its data position's samples consumed disagree with its step and skips"
    if proof.ledger is None:
        return "its ledger is unknown (the run resumed from a checkpoint written before ledgers)"
    if proof.samples != info.step * batch:
        return f"its ledger counts {proof.samples} samples, not the {info.step * batch} of {info.step} steps"
    if proof.samples > MAX_SAMPLES:
        return f"its {proof.samples} samples are more than this command verifies ({MAX_SAMPLES})"
    n_samples = _samples_in(m.get("dataset_uri"), block, plans)
    if data_index(info.step + 1, skips) * batch // n_samples > MAX_EPOCHS:
        return f"it covers more than {MAX_EPOCHS} epochs of {n_samples} samples, more than this command verifies"
    if plans.ledger(info.step, skips, batch, seed, n_samples).hex() != proof.ledger:
        return "its ledger is not the sample order's: some sample was consumed twice, or another in its place"
    checked.samples, checked.epochs = proof.samples, round(proof.samples / n_samples, 4)
    return ""


def _bounded(value: Any, name: str, low: int = 1, high: int = 1 << 31) -> int:
    if type(value) is not int or not low <= value < high:
        raise ValueError(f"{name} {_short(repr(value))} is not an integer in [{low}, {high})")
    return value


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _samples_in(uri: Any, block: int, plans: _Plans) -> int:
    """How many samples of ``block`` tokens the train split of the store's dataset ``uri`` holds."""
    from trainpipe.trainer.data.tokens import TokenStream

    name = posixpath.basename(uri.rstrip("/")) if isinstance(uri, str) else ""
    if not DATASET_ID.fullmatch(name) or uri.rstrip("/") != dataset_uri(plans.root, name):
        raise ValueError(f"its dataset is not one of this store's datasets: {_short(repr(uri), 60)}")
    key = f"{uri}|{block}"
    if key not in plans.samples_in:
        plans.samples_in[key] = TokenStream(uri, "train", plans.so, verify=False).windows(block)
    if plans.samples_in[key] < 1:
        raise ValueError(f"the dataset holds no sample of {block} tokens")
    return plans.samples_in[key]
