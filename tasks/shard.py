from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trainer.config import DataConfig, StoreConfig
from trainer.data.shard import DatasetInfo
from trainer.data.shard import shard_dataset as shard


@task(
    name="shard_dataset", task_run_name="shard-{data.source}", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE
)
def shard_dataset(
    data: DataConfig, store: StoreConfig, progress: bool = False, block_size: int | None = None
) -> DatasetInfo:
    """Tokenize the corpus into content-addressed shards; a second run with the same inputs writes nothing.
    With ``block_size``, each split must hold one training sample."""
    logger = get_run_logger()
    info = shard(data, store, progress=progress, block_size=block_size)
    splits = info.manifest["splits"]
    logger.info(
        "dataset %s %s: %d train / %d val tokens in %d shards at %s",
        info.dataset_id,
        "reused (cache hit)" if info.cache_hit else "written",
        splits["train"]["tokens"],
        splits["val"]["tokens"],
        len(splits["train"]["shards"]) + len(splits["val"]["shards"]),
        info.uri,
    )
    return info
