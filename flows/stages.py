"""One-stage flows, so each stage can also run alone from the CLI or the Prefect UI."""

from __future__ import annotations

import dataclasses
from typing import Any

from prefect import flow

from trainpipe.flows.shard import shard_corpus
from trainpipe.tasks.preflight import preflight_cluster
from trainpipe.tasks.validate import validate_checkpoint
from trainpipe.trainer.orchestrate.resolve import request_key, resolve, take_over
from trainpipe.trainer.profile_files import load_profile


@flow(name="trainpipe-shard", flow_run_name="shard-{profile}")
def shard_flow(
    profile: str = "local", overrides: list[str] | None = None, progress: bool = False, verify: bool = False
) -> dict[str, Any]:
    """Tokenize and shard the profile's data source into the store; ``verify`` hashes an existing dataset's
    files (and rebuilds it if one is damaged) instead of trusting their sizes."""
    prof, _ = take_over(request_key("shard", profile, overrides)) or resolve(profile, overrides, run_name="shard")
    info = shard_corpus(prof.data, prof.store, progress, prof.model.block_size, prof.model.vocab_size, verify)
    return {
        "dataset_id": info.dataset_id,
        "uri": info.uri,
        "cache_hit": info.cache_hit,
        "work": dataclasses.asdict(info.work),
        "manifest": info.manifest,
    }


@flow(name="trainpipe-preflight", flow_run_name="preflight-{profile}")
def preflight_flow(profile: str = "local", overrides: list[str] | None = None) -> dict[str, Any]:
    """Check the cluster, software and store the profile describes."""
    handed = take_over(request_key("preflight", profile, overrides))
    prof, _ = handed or resolve(profile, overrides, run_name="preflight")
    return preflight_cluster(prof)


@flow(name="trainpipe-validate", flow_run_name="validate")
def validate_flow(uri: str, profile: str = "local", overrides: list[str] | None = None) -> dict[str, Any]:
    """Prove one checkpoint complete, uncorrupted, loadable and sane."""
    return validate_checkpoint(uri, load_profile(profile, overrides or []))
