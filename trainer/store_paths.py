"""Where everything lives in the object store (docs/architecture.md §3): the one module that builds store paths.

{root}/datasets/{dataset_id}/manifest.json      one dataset: its shards are pieces' files (written last)
{root}/datasets/pieces/{key}/train-000000.bin, …, piece.json   one piece's tokens (piece.json written last)
{root}/datasets/tokenizers/{sha256}.json        the tokenizer.json of datasets made with one
{root}/datasets/sources/{key}.json              the newest dataset of one source and settings (for reuse)
{root}/runs/{run}/profile.yaml                  the resolved profile the run trains with
{root}/runs/{run}/incidents.json                every incident of the run, in order
{root}/runs/{run}/attempts.json                 one record per training attempt
{root}/runs/{run}/excluded_nodes.json           nodes a straggler policy took out
{root}/runs/{run}/rollbacks.json                steps of loss spikes the run rolled back from
{root}/runs/{run}/jobs.json                     cluster jobs submitted and not yet seen to end
{root}/runs/{run}/checkpoints/step-{N:08d}/     DCP files, extra/rank-*.pt, trainpipe.json (written last)
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass

CHECKPOINT_MANIFEST = "trainpipe.json"
DATASET_MANIFEST = "manifest.json"
RUN_PROFILE = "profile.yaml"
_STEP_DIR = re.compile(r"step-(\d{8})$")
# A run name is a folder in the store, an MLflow tag value and a Prefect flow-run name: only characters safe in
# all three (no '/', no quotes, no glob characters).
RUN_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}"
RUN_NAME_PATTERN = rf"^{RUN_NAME}$"  # for pydantic and JSON schema, whose '$' is the end (Python's allows a '\n')


def check_run_name(name: str) -> str:
    """``name`` if it is a valid run name, else ValueError saying what one looks like."""
    if not isinstance(name, str) or not re.fullmatch(RUN_NAME, name):
        raise ValueError(
            f"run name {name!r} is not valid: use 1-80 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def store_tag(root: str) -> str:
    """A short hash of a store root: what ties a flow run, a Slurm job or a TrainJob to the store its run lives
    in, so two stores holding runs of one name never take each other's for their own."""
    return hashlib.sha256(root.rstrip("/").encode()).hexdigest()[:8]


def join(root: str, *parts: str) -> str:
    root = root.rstrip("/")
    return posixpath.join(root, *[p.strip("/") for p in parts])


def dataset_uri(root: str, dataset_id: str) -> str:
    return join(root, "datasets", dataset_id)


def datasets_uri(root: str) -> str:
    return join(root, "datasets")


PIECE_RECORD = "piece.json"


def piece_folder(key: str) -> str:
    """A piece's folder, relative to the datasets folder: its key decides it, so equal pieces share one."""
    return f"pieces/{key[:32]}"


def tokenizer_file(sha256: str) -> str:
    return f"tokenizers/{sha256}.json"


def source_pointer(key: str) -> str:
    return f"sources/{key[:32]}.json"


def step_uri(checkpoints: str, step: int) -> str:
    """The folder of the checkpoint of ``step`` under a run's ``checkpoints`` folder."""
    return join(checkpoints, f"step-{step:08d}")


def step_of(uri: str) -> int | None:
    """The step a checkpoint folder is named for; None when the name is not ``step-NNNNNNNN``."""
    m = _STEP_DIR.search(uri.rstrip("/"))
    return int(m.group(1)) if m else None


def rank_extra(checkpoint: str, rank: int) -> str:
    return join(checkpoint, "extra", f"rank-{rank:05d}.pt")


def run_of_checkpoint(checkpoint: str) -> str:
    """``{root}/runs/{run}`` for ``{root}/runs/{run}/checkpoints/step-N``."""
    return checkpoint.rstrip("/").rsplit("/", 2)[0]


def profile_of_checkpoint(checkpoint: str) -> str:
    """The resolved profile of the run a checkpoint belongs to."""
    return join(run_of_checkpoint(checkpoint), RUN_PROFILE)


@dataclass(frozen=True)
class RunPaths:
    """The paths of one run under a store root."""

    root: str
    name: str

    @property
    def dir(self) -> str:
        return join(self.root, "runs", self.name)

    @property
    def checkpoints(self) -> str:
        return join(self.dir, "checkpoints")

    @property
    def profile(self) -> str:
        return join(self.dir, RUN_PROFILE)

    @property
    def incidents(self) -> str:
        return join(self.dir, "incidents.json")

    @property
    def attempts(self) -> str:
        return join(self.dir, "attempts.json")

    @property
    def excluded_nodes(self) -> str:
        return join(self.dir, "excluded_nodes.json")

    @property
    def rollbacks(self) -> str:
        return join(self.dir, "rollbacks.json")

    @property
    def live_jobs(self) -> str:
        """The cluster jobs the run submitted that may still run (``trainer.launch.jobs``)."""
        return join(self.dir, "jobs.json")

    def job(self, attempt: int, tag: str) -> str:
        """Where a cluster launcher's hosts leave their parts of attempt ``attempt`` (``tag``: that job's own)."""
        return join(self.dir, "jobs", f"attempt-{attempt}-{tag}")

    def diagnostics(self, attempt: int) -> str:
        """What was gathered when attempt ``attempt`` failed (the ranks' flight recorders)."""
        return join(self.dir, "diagnostics", f"attempt-{attempt}")

    def checkpoint(self, step: int) -> str:
        return step_uri(self.checkpoints, step)
