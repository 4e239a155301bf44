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
from trainpipe.trainer.checkpoint.proof import CheckpointProof
from trainpipe.trainer.data.sampler import DataSkip, data_index
from trainpipe.trainer.incidents import AttemptRecord
from trainpipe.trainer.layout import dataset_uri

DATASET_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
LIMIT = 1 << 31  # a global batch, a seed or a block size beyond this is not one a run used


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
    samples_of: dict[str, int] = {}
    for info in list_checkpoints(checkpoints, storage_options):
        if info.committed:
            report.checked.append(_check(info, store_root, storage_options, samples_of))
    return report


def _check(info: CheckpointInfo, root: str, so: dict[str, Any] | None, samples_of: dict[str, int]) -> Checked:
    checked = Checked(info.step, info.uri)
    if not info.valid:
        checked.problem = info.reason
        return checked
    proof = read_proof(info.manifest)
    if proof is None:
        checked.problem = "it records no proof (written before checkpoints recorded a state hash and a ledger)"
        return checked
    try:
        checked.problem = _ledger_problem(info, proof, root, so, samples_of, checked)
    except (ValueError, ValidationError) as exc:
        checked.problem = f"its manifest's data position is not one ({str(exc).splitlines()[0][:200]})"
    return checked


def _ledger_problem(
    info: CheckpointInfo,
    proof: CheckpointProof,
    root: str,
    so: dict[str, Any] | None,
    samples_of: dict[str, int],
    checked: Checked,
) -> str:
    from trainpipe.trainer.checkpoint.state_hash import planned_ledger

    m = info.manifest
    position, profile = m.get("data_position"), m.get("profile")
    if not isinstance(position, dict) or not isinstance(profile, dict):
        raise ValueError("no data_position or profile")
    batch = _bounded((profile.get("train") or {}).get("global_batch"), "global_batch")
    block = _bounded((profile.get("model") or {}).get("block_size"), "block_size")
    seed = _bounded(position.get("seed"), "seed", low=0)
    skips = [DataSkip.model_validate(k) for k in position.get("skips") or []][:64]
    if position.get("next_step") != info.step:
        return f"its data position is at step {position.get('next_step')!r}, not {info.step}"
    if position.get("samples_consumed") != data_index(info.step + 1, skips) * batch:
        return "its data position's samples consumed disagree with its step and skips"
    if proof.ledger is None:
        return "its ledger is unknown (the run resumed from a checkpoint written before ledgers)"
    if proof.samples != info.step * batch:
        return f"its ledger counts {proof.samples} samples, not the {info.step * batch} of {info.step} steps"
    n_samples = _samples_in(m.get("dataset_uri"), block, root, so, samples_of)
    planned = planned_ledger(info.step, skips, batch, seed, n_samples)
    if planned.hex() != proof.ledger:
        return "its ledger is not the sample order's: some sample was consumed twice, or another in its place"
    checked.samples, checked.epochs = proof.samples, round(proof.samples / n_samples, 4)
    return ""


def _bounded(value: Any, name: str, low: int = 1) -> int:
    if type(value) is not int or not low <= value < LIMIT:
        raise ValueError(f"{name} {value!r} is not an integer in [{low}, 2^31)")
    return value


def _samples_in(uri: Any, block: int, root: str, so: dict[str, Any] | None, cache: dict[str, int]) -> int:
    """How many samples of ``block`` tokens the train split of the store's dataset ``uri`` holds."""
    from trainpipe.trainer.data.tokens import TokenStream

    name = posixpath.basename(uri.rstrip("/")) if isinstance(uri, str) else ""
    if not DATASET_ID.fullmatch(name) or uri.rstrip("/") != dataset_uri(root, name):
        raise ValueError(f"its dataset {str(uri)[:200]!r} is not one of this store's datasets")
    key = f"{uri}|{block}"
    if key not in cache:
        cache[key] = TokenStream(uri, "train", so, verify=False).windows(block)
    if cache[key] < 1:
        raise ValueError(f"the dataset holds no sample of {block} tokens")
    return cache[key]
