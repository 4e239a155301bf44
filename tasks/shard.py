"""The shard stage's tasks: plan the pieces, tokenize one piece (mapped over the engine's task runner by
flows/shard.py), assemble the dataset. Thin: the work is trainer/data's."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trainpipe.tasks.common import retry_on_store_error
from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data import piece as pieces
from trainpipe.trainer.data import shard, source_hashes
from trainpipe.trainer.data.piece import Lookup, PieceResult, ShardJob
from trainpipe.trainer.data.plan import PieceSpec
from trainpipe.trainer.data.shard import DatasetInfo, ShardPlan

_STORE_RETRIES = {
    "retries": 2,
    "retry_delay_seconds": [2, 10],
    "retry_condition_fn": retry_on_store_error,
    "cache_policy": NO_CACHE,
    "persist_result": False,
}


@task(name="plan_shards", task_run_name="plan-shards", **_STORE_RETRIES)
def plan_shards(data: DataConfig, store: StoreConfig, verify: bool = False) -> ShardPlan:
    """List the source and cut it into pieces; a bpe tokenizer is trained here, on a bounded sample."""
    plan = shard.prepare_shards(data, store, verify)
    n, size = len(plan.pieces), plan.bytes / 2**20
    get_run_logger().info("%d files, %.1f MB in %d piece(s) of about %g MB", plan.files, size, n, data.piece_mb)
    return plan


@task(name="find_pieces", task_run_name="find-pieces", **_STORE_RETRIES)
def find_pieces(job: ShardJob, candidates: list[PieceSpec], hash_cache: str | None = None) -> list[Lookup]:
    """Each piece looked up in the store (the files an earlier piece holds hashed against its record, or their
    hashes taken from ``hash_cache`` while their stat is unchanged): found whole, or the bytes left to tokenize,
    so that no more worker processes start than there is work for."""
    logger = get_run_logger()
    looked, known = [], 0
    with source_hashes.opened(hash_cache, logger.warning) as cache:
        for p in candidates:
            hashes = cache.known(enumerate(p.segments)) if cache and p.reuse else {}
            known += len(hashes)
            looked.append(pieces.find_piece(job, p, hashes))
    found = sum(lookup.found is not None for lookup in looked)
    new = sum(lookup.new_bytes for lookup in looked) / 2**20
    logger.info(
        "%d of %d pieces found in the store; %.1f MB to tokenize; %d unchanged file(s)/range(s) known by their stat",
        found,
        len(looked),
        new,
        known,
    )
    return looked


@task(name="tokenize_piece", task_run_name="piece-{piece.index}", **_STORE_RETRIES)
def tokenize_piece(job: ShardJob, piece: PieceSpec, hashed: dict[int, str] | None = None) -> PieceResult:
    """Read one piece once and write its shards, or find them in the store; a bad record is a warning line.
    ``hashed``: the segments the find pass hashed already."""
    return pieces.tokenize_piece(job, piece, get_run_logger().warning, hashed)


@task(name="assemble_dataset", task_run_name="assemble-dataset", **_STORE_RETRIES)
def assemble_dataset(
    plan: ShardPlan, results: list[PieceResult], started: float, hash_cache: str | None = None
) -> DatasetInfo:
    """Write the dataset's manifest from its pieces (last: nothing partial is published) and say what it holds;
    the hashes of its source's segments go into ``hash_cache`` for the next find pass."""
    logger = get_run_logger()
    info = shard.assemble_dataset(plan, results, started)
    with source_hashes.opened(hash_cache, logger.warning) as cache:
        if cache is not None:
            cache.remember(shard.segment_hashes(plan, results))
    splits, source, work = info.manifest["splits"], info.manifest["source"], info.work
    logger.info(
        "dataset %s %s: %d train / %d val tokens in %d shards of %d piece(s) (%d reused whole, %.1f MB tokenized) at "
        "%s (tokenizer %s, %d tokens)",
        info.dataset_id,
        "reused (cache hit)" if info.cache_hit else "written",
        splits["train"]["tokens"],
        splits["val"]["tokens"],
        len(splits["train"]["shards"]) + len(splits["val"]["shards"]),
        work.pieces,
        work.reused,
        work.tokenized_bytes / 2**20,
        info.uri,
        info.manifest["tokenizer"]["name"],
        info.manifest["tokenizer"]["vocab_size"],
    )
    if source["skipped_records"]:
        logger.warning(
            "%d unreadable records skipped, the first: %s", source["skipped_records"], source["first_skipped"][0]
        )
    return info
