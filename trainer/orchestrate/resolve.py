"""A run request (profile, overrides, run name) checked into a profile and a run name, before any work starts.

Light on purpose (no torch, no prefect): the CLI calls it first, so a mistake
costs a second and one line, not a server start.
"""

from __future__ import annotations

import datetime as dt

from trainer.config import Profile, load_profile
from trainer.data.sources import check_source
from trainer.store import check_writable


def new_run_name(profile: Profile) -> str:
    return f"{profile.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"


def resolve(profile: str, overrides: list[str] | None, run_name: str | None) -> tuple[Profile, str]:
    """Load the profile with its overrides, name the run, and check the store and the data source."""
    prof = load_profile(profile, overrides or [])
    name = run_name or prof.train.run_name or new_run_name(prof)
    prof.train.run_name = name
    check_writable(prof.store.root, prof.store.storage_options)
    check_source(prof.data, prof.store)
    return prof, name
