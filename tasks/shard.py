from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from trainpipe.tasks.common import retry_on_store_error
from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data.shard import DatasetInfo
from trainpipe.trainer.data.shard import shard_dataset as shard


class _ProgressArtifact:
    """The shard stage's progress as a Prefect progress artifact, updated at most every two seconds."""

    def __init__(self, source: str):
        self.source, self.id, self.phase, self.last, self.failed = source, None, "", 0.0, False

    def __call__(self, phase: str, fraction: float) -> None:
        now = time.monotonic()
        if phase == self.phase and fraction < 1.0 and now - self.last < 2.0:
            return
        self.phase, self.last = phase, now
        # Shown as one bar over the passes: read, (train bpe), tokenize.
        overall = 100.0 * {"read": 0.0, "train bpe": 1.0, "tokenize": 2.0}.get(phase, 0.0) / 3 + 100.0 * fraction / 3
        description = f"shard {self.source}: {phase}"
        self._show(overall, description)

    def finish(self, description: str) -> None:
        self._show(100.0, f"shard {self.source}: {description}")

    def _show(self, percent: float, description: str) -> None:
        if self.failed:
            return
        try:
            if self.id is None:
                self.id = create_progress_artifact(percent, description=description)
            else:
                update_progress_artifact(self.id, percent, description=description)
        except Exception as exc:  # noqa: BLE001 - progress is worth a warning, never the stage
            self.failed = True
            get_run_logger().warning("shard progress artifact not updated (%s: %s)", exc.__class__.__name__, exc)


@task(
    name="shard_dataset",
    task_run_name="shard-{data.source}",
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=retry_on_store_error,
    cache_policy=NO_CACHE,
)
def shard_dataset(
    data: DataConfig,
    store: StoreConfig,
    progress: bool = False,
    block_size: int | None = None,
    vocab_size: int | None = None,
    verify: bool = False,
) -> DatasetInfo:
    """Tokenize the corpus into content-addressed shards; a second run with the same inputs writes nothing.
    With ``block_size`` each split must hold one training sample, with ``vocab_size`` the model must cover
    the tokenizer. ``progress`` draws a bar on the terminal; a progress artifact follows it in any case.
    ``verify`` checks every file of an existing dataset against its sha256, not only its size."""
    logger = get_run_logger()
    artifact = _ProgressArtifact(data.source)
    info = shard(
        data,
        store,
        progress=progress,
        block_size=block_size,
        vocab_size=vocab_size,
        on_progress=artifact,
        warn=logger.warning,
        verify=verify,
    )
    artifact.finish(f"dataset {info.dataset_id} " + ("reused" if info.cache_hit else "written"))
    splits, source = info.manifest["splits"], info.manifest.get("source")
    logger.info(
        "dataset %s %s: %d train / %d val tokens in %d shards at %s (tokenizer %s, %d tokens)",
        info.dataset_id,
        "reused (cache hit)" if info.cache_hit else "written",
        splits["train"]["tokens"],
        splits["val"]["tokens"],
        len(splits["train"]["shards"]) + len(splits["val"]["shards"]),
        info.uri,
        info.manifest["tokenizer"]["name"],
        info.manifest["tokenizer"]["vocab_size"],
    )
    if not info.cache_hit and source["skipped_records"]:  # the manifest this call wrote, not one from the store
        logger.warning(
            "%d unreadable records skipped, the first: %s", source["skipped_records"], source["first_skipped"][0]
        )
    return info
