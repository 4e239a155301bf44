"""A run request (profile, typed values, overrides, run name) checked into a profile and a run name, before any
work starts.

Light on purpose (no prefect, and torch only to check a model.factory other than the built-in GPT): the
CLI calls it first, so a mistake costs a second and one line, not a server start. The request is resolved once:
the CLI hands what it resolved to the flow it then runs in the same process (``hand_over``, ``take_over``); a
flow run a deployment started resolves its request itself.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import secrets
from collections.abc import Mapping
from typing import Any

from trainpipe.trainer import store_retry
from trainpipe.trainer.checkpoint.catalog import list_checkpoints
from trainpipe.trainer.config import GPT_FACTORY, Profile
from trainpipe.trainer.data.sources import check_source, source_options
from trainpipe.trainer.data.tokenizer import check_tokenizer
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.launch import check_launcher
from trainpipe.trainer.orchestrate.resume_pins import RESUME_PINNED, resume_differences
from trainpipe.trainer.orchestrate.run_form import check_form_overrides
from trainpipe.trainer.profile_files import known_profiles, load_profile
from trainpipe.trainer.store import check_writable, filesystem
from trainpipe.trainer.store_paths import RunPaths, check_run_name


def new_run_name(profile_name: str) -> str:
    """The profile's name, the time and a random suffix: two runs started in the same second differ."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", profile_name)[:40].lstrip("._-") or "run"
    return f"{stem}-{dt.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(4)}"


def run_exists(profile: Profile, name: str) -> bool:
    fs, path = filesystem(RunPaths(profile.store.root, name).dir, profile.store.storage_options)
    return fs.exists(path)


def resolve(
    profile: str,
    overrides: list[str] | None,
    run_name: str | None,
    resume: bool = False,
    values: Mapping[str, Any] | None = None,
    fresh: bool = False,
) -> tuple[Profile, str]:
    """Load the profile with its typed ``values`` and overrides, name the run, and check the store and the data
    source.

    ``resume``: ``run_name`` must name a run that exists in the store. ``fresh``: it must not (a name from
    Prefect's Run Name box, which Prefect fills with a random one: a repeat would continue a stranger's run).
    """
    prof = load_profile(profile, overrides or [], values)
    check_launcher(prof)  # its launcher's own section (launcher.<kind>), checked by the launcher's module
    name = run_name or prof.train.run_name or new_run_name(prof.name)
    try:
        check_run_name(name)
    except ValueError as exc:
        raise ProfileError(str(exc)) from None
    prof.train.run_name = name
    store_retry.set_budget(prof.store.retry_s)  # this process's store calls from here on (the pipeline's tasks)
    check_writable(prof.store.root, prof.store.storage_options)
    if resume and not run_exists(prof, name):
        raise ProfileError(
            f"there is no run {name!r} to resume under {prof.store.root}/runs; "
            "leave resume empty to start it, or check the profile's store"
        )
    if fresh and run_exists(prof, name):
        raise ProfileError(
            f"run {name!r} already exists under {prof.store.root}/runs: a name in Prefect's Run Name box starts a "
            f"new run; to continue {name}, give it as the form's Resume run, or choose another Run Name"
        )
    check_source(prof.data, prof.store)
    check_tokenizer(prof.data, source_options(prof.data.tokenizer, prof.store), prof.model.vocab_size)
    if prof.model.factory != GPT_FACTORY:  # the built-in GPT is checked with the profile, without torch
        from trainpipe.trainer.factory import check_layout, check_model

        check_model(prof.model)
        check_layout(prof.model, prof.layout, prof.parallel.loss_parallel)
    check_resumable(prof, name)
    return prof, name


_HANDED: dict[str, tuple[Profile, str]] = {}


def request_key(*request: Any) -> str:
    """One string per request (a flow's parameters as JSON, or its arguments): what a hand-over is found by."""
    return json.dumps(request, sort_keys=True, default=str)


def hand_over(key: str, resolved: tuple[Profile, str]) -> None:
    """Keep what the CLI resolved for the flow it runs next in this process, which takes it once."""
    _HANDED[key] = resolved


def take_over(key: str) -> tuple[Profile, str] | None:
    """What the CLI resolved for exactly this request, once; None when nothing was handed over (a deployment's flow
    run, or a flow called on its own), and the flow resolves the request itself."""
    return _HANDED.pop(key, None)


def check_form_request(profile: str, overrides: list[str]) -> None:
    """ProfileError unless a deployment's run form asks for a profile that ships in profiles/ (by name, not a
    path) and only for overrides that profile's ``deploy.overridable`` allows, as the operator wrote it (a form
    cannot widen the list with an override of its own)."""
    if profile not in known_profiles():
        raise ProfileError(
            f"profile {profile!r} is not one of the deployment's profiles ({', '.join(known_profiles())})"
        )
    check_form_overrides(load_profile(profile, []), overrides)


def check_resumable(profile: Profile, name: str) -> None:
    """ProfileError when the run's newest checkpoint was trained with other data, model, optimizer or seed."""
    paths = RunPaths(profile.store.root, name)
    committed = [i for i in list_checkpoints(paths.checkpoints, profile.store.storage_options, verify=False) if i.valid]
    if not committed or not isinstance(recorded := committed[-1].manifest.get("profile"), dict):
        return
    if differences := resume_differences(recorded, profile):
        raise ProfileError(
            f"run {name} resumes from {committed[-1].uri.rsplit('/', 1)[-1]}, trained with other settings: "
            f"{'; '.join(differences)}. Set them back to resume it, or start a new --run-name "
            f"(a resume may change only keys outside {', '.join(RESUME_PINNED)}, e.g. train.steps)"
        )
