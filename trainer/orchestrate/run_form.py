"""What a deployment's run form may set (docs/security.md, "The run form"): the keys a form may override by
default, those only the operator sets, the guards a form may only tighten, and the checks a form's request passes
(``check_form_overrides``) before it resolves into a profile."""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.profile_files import build_profile, parse_override, set_value

# What a deployment's run form may override by default: how long and how it trains, never where data comes from
# or goes, what code is imported, or who is called (docs/security.md). The typed form fields are always allowed.
# Nor may it switch supervision off, inject faults or hold a rank asleep: a profile for drills opens faults.*.
FORM_OVERRIDABLE = (
    "train.*",
    "model.n_layer",
    "model.n_head",
    "model.n_embd",
    "model.block_size",
    "model.dropout",
    "checkpoint.*",
    *(
        f"watchdog.{key}"
        for key in (
            "hang_timeout_s",
            "hang_floor_s",
            "hang_factor",
            "stopped_after_s",
            "startup_timeout_s",
            "slow_phase_timeout_s",
            "exit_timeout_s",
            "poll_s",
            "pg_timeout_s",
            "straggler_window",
            "straggler_factor",
            "straggler_patience",
            "on_straggler",
            "health_window",
            "loss_spike_factor",
            "grad_spike_factor",
            "on_loss_spike",
            "flatline_steps",
            "on_flatline",
            "network_factor",
            "data_stall_share",
            "on_network",
            "on_data_stall",
            "gpu_idle_pct",
        )
    ),
    "preflight.*",
    "cost.*",
    "data.max_bytes",
    "data.shard_tokens",
    "data.val_fraction",
    "data.buffer_mb",
    "data.max_bad_records",
)
# Never from a form through `default` or `section.*`: what the run's policy records for itself (a rollback makes
# the run refuse, and in time delete, its newer checkpoints; a link probe's verdict excludes a node).
OPERATOR_ONLY = (
    "train.rollbacks",
    # The engine's workers receive the store's credentials: where they run is the operator's.
    "data.engine",
    "data.engine_connect_s",
    "data.engine_no_worker_s",
    "watchdog.probe_links",
    # The registry is shared: which model a run's versions join and when its champion moves are the operator's
    # (docs/security.md), never a form's through section.*.
    "publish.enabled",
    "publish.registered_model",
    "publish.gate_tolerance",
    "publish.gate_max_val_loss",
)

# A run form may make a run shorter, smaller or noisier, never less guarded (docs/security.md, "The run form"):
# each guard of the default list moves only the way that detects sooner or acts harder, and a policy that writes
# into the run's shared records (excluding a node, rolling back) stays exactly as the operator set it.
FORM_AT_MOST = (  # lower is tighter: an allowance, a window, a detection threshold
    "watchdog.hang_floor_s",
    "watchdog.hang_factor",
    "watchdog.stopped_after_s",
    "watchdog.startup_timeout_s",
    "watchdog.slow_phase_timeout_s",
    "watchdog.exit_timeout_s",
    "watchdog.poll_s",
    "watchdog.pg_timeout_s",
    "watchdog.straggler_window",
    "watchdog.straggler_patience",
    "watchdog.straggler_factor",
    "watchdog.health_window",
    "watchdog.loss_spike_factor",
    "watchdog.grad_spike_factor",
    "watchdog.flatline_steps",
    "watchdog.network_factor",
    "watchdog.data_stall_share",
    "train.timeout_s",
)
# higher is tighter: a warning's bar; a check on; committed checkpoints kept (fewer would prune a resumed run's)
FORM_AT_LEAST = ("watchdog.gpu_idle_pct", "checkpoint.verify_state", "checkpoint.keep_last")
# Each policy's actions from the mildest; a form may move one later in its order, never earlier. A policy whose
# action writes the run's records is not in the order: a form may neither choose it nor leave it.
FORM_POLICIES = {
    "watchdog.on_straggler": ("warn", "abort"),
    "watchdog.on_loss_spike": ("warn", "stop"),
    "watchdog.on_flatline": ("warn", "stop"),
    "watchdog.on_network": ("warn", "abort"),
    "watchdog.on_data_stall": ("warn", "abort"),
    "preflight.on_fail": ("stop",),
}
# What feeds a record-writing policy: under it, a form leaves these as the operator set them (a straggler factor
# near 1 under exclude writes a healthy node into the run's exclusions; a preflight bar under exclude likewise).
FORM_FEEDS = {
    ("watchdog.on_straggler", "exclude"): ("watchdog.straggler_factor", "watchdog.straggler_patience",
                                           "watchdog.straggler_window"),
    ("watchdog.on_loss_spike", "rollback"): ("watchdog.loss_spike_factor", "watchdog.grad_spike_factor",
                                             "watchdog.health_window"),
    ("preflight.on_fail", "exclude"): ("preflight.*",),
}  # fmt: skip
# On more than one node a host that crashed or hung twice is excluded whatever the policies say
# (policy.after_attempt): what makes a hang or a crash there feeds that too.
FORM_FEEDS_ACROSS_NODES = (
    "watchdog.hang_timeout_s",
    "watchdog.hang_floor_s",
    "watchdog.hang_factor",
    "watchdog.stopped_after_s",
    "watchdog.startup_timeout_s",
    "watchdog.slow_phase_timeout_s",
    "watchdog.exit_timeout_s",
    "watchdog.pg_timeout_s",
    "faults.*",
)
# A drill whose incident sets a record-writing policy off: (fault kind, the policy and its action).
FORM_DRILLS = {"loss_spike": ("watchdog.on_loss_spike", "rollback")}
# Overridable keys whose value names a path: a run form's value must lie under deploy.path_roots, unless it is
# one of the names those keys also take.
PATH_KEYS = ("data.source", "data.tokenizer", "store.root", "launcher.shared_dir")
NAMED_VALUES = {("data.source", "stdlib"), ("data.tokenizer", "byte"), ("data.tokenizer", "bpe")}


def check_form_overrides(profile: Profile, overrides: list[str]) -> None:
    """ProfileError unless a deployment's run form may set each of ``overrides``: its key is in the profile's
    ``deploy.overridable`` (``section.*`` covers a section), and a path it names lies under ``deploy.path_roots``.

    A run-form user may trigger and cancel runs, not act as the operator (docs/security.md)."""
    allowed = set(profile.deploy.overridable) | (
        set(FORM_OVERRIDABLE) if "default" in profile.deploy.overridable else set()
    )
    for item in overrides:
        parts, value = parse_override(item)
        section, name = parts[0], ".".join(parts[:2])  # launcher.slurm.partition is an item of launcher.slurm
        if len(parts) == 3 and ".".join(parts) in allowed:  # the operator opened this one item alone
            continue
        if name in OPERATOR_ONLY and name not in profile.deploy.overridable:
            raise ProfileError(
                f"{name} cannot be set from the run form: it is the run's own record (set by its policy); only "
                "a profile whose deploy.overridable names it exactly lets a form set it"
            )
        if name not in allowed and f"{section}.*" not in allowed:
            raise ProfileError(
                f"{name} cannot be set from the run form: the profile's deploy.overridable does not list it "
                "(the operator chooses which keys a form may set)"
            )
        if isinstance(value, str) and (name, value) in NAMED_VALUES:  # the standard library's source, a tokenizer
            continue
        if name in PATH_KEYS and not _under_roots(str(value), profile.deploy.path_roots):
            roots = ", ".join(profile.deploy.path_roots) or "none configured"
            raise ProfileError(f"{name}={value!r} is not under the profile's deploy.path_roots ({roots})")
    if overrides:
        check_form_guards(profile, _overridden(profile, overrides), overrides)


def _overridden(profile: Profile, overrides: list[str]) -> Profile:
    """``profile`` with the form's ``overrides`` applied (values as given: a form's value is data, never a template)."""
    body = profile.model_dump(mode="json", by_alias=True)
    for item in overrides:
        parts, value = parse_override(item)
        set_value(body, parts, value)
    return build_profile(body, origin="the run form").with_secrets(profile._secrets)


def _value(profile: Profile, name: str) -> Any:
    section, key = name.split(".")
    return getattr(getattr(profile, section), key)


def check_form_guards(own: Profile, asked: Profile, overrides: list[str]) -> None:
    """ProfileError when a run form's overrides leave ``asked`` less guarded than the operator's ``own`` profile:
    an allowance or threshold loosened, a policy made milder, a record-writing policy chosen or left, or what
    feeds one changed (the tables above). An operator who lists a key in ``deploy.overridable``
    by name lets a form move it either way."""
    named = set(own.deploy.overridable) - {"default"}  # keys the operator wrote by name, not trainpipe's list

    def refuse(name: str, why: str) -> None:
        raise ProfileError(
            f"{name}={_value(asked, name)!r} cannot be set from the run form: {why} (a form may make a run shorter, "
            "smaller or noisier, never less guarded; an operator who lists the key by name in deploy.overridable "
            "lets it)"
        )

    for name in FORM_AT_MOST + FORM_AT_LEAST:
        mine, theirs = _value(own, name), _value(asked, name)
        if name not in named and (theirs > mine if name in FORM_AT_MOST else theirs < mine):
            refuse(name, f"the profile's {mine!r} is tighter")
    mine, theirs = own.watchdog.hang_timeout_s, asked.watchdog.hang_timeout_s
    bound = mine if mine is not None else own.watchdog.hang_floor_s  # the adaptive allowance is never below it
    looser = (theirs is None and mine is not None) or (theirs or 0) > bound
    if "watchdog.hang_timeout_s" not in named and looser:
        refuse("watchdog.hang_timeout_s", f"the longest it may be is {bound:g}s, the profile's own allowance")
    for name, order in FORM_POLICIES.items():
        mine, theirs = _value(own, name), _value(asked, name)
        if name in named or mine == theirs:
            continue
        if theirs not in order:
            refuse(name, "it writes into the run's records")
        if mine not in order and theirs != order[-1]:  # from a record-writing policy, only to the hardest
            refuse(name, f"the profile's {mine!r} acts on it; a form may only make it {order[-1]!r}")
        if mine in order and order.index(theirs) < order.index(mine):
            refuse(name, f"the profile's {mine!r} acts harder")
    keys = {item.split("=", 1)[0].strip() for item in overrides}
    feeding = [(f"{p}={a}", fed) for (p, a), fed in FORM_FEEDS.items() if _value(asked, p) == a]
    if own.cluster.nodes > 1:
        feeding.append(("a node's exclusion after two crashes or hangs", FORM_FEEDS_ACROSS_NODES))
    for what, fed in feeding:
        for key in keys - named - {"preflight.enabled"}:  # a preflight that does not run excludes no one
            feeds = any(key == f or (f.endswith(".*") and key.startswith(f[:-1])) for f in fed)
            if feeds and _value(asked, key) != _value(own, key):
                refuse(key, f"it feeds {what}, which writes into the run's records")
    drill = FORM_DRILLS.get(asked.faults.kind)
    if (
        drill
        and asked.faults.kind != own.faults.kind
        and "faults.kind" not in named
        and _value(asked, drill[0]) == drill[1]
    ):
        refuse("faults.kind", f"its incident sets {drill[0]}={drill[1]} off, which writes into the run's records")


def _under_roots(value: str, roots: list[str]) -> bool:
    """Whether ``value``, a path or URI, lies under one of ``roots`` once '.', '..' and links are resolved
    (``~`` is refused: whose home it names depends on who runs the worker)."""
    # '~' is whose home?, a glob could match a link that leads out, and '::' chains a second path fsspec opens
    if value.startswith("~") or any(c in value for c in "*?[") or "::" in value:
        return False

    def norm(v: str) -> str:
        if v.startswith("file://"):
            v = v.removeprefix("file://")
        if "://" in v:
            scheme, rest = v.split("://", 1)
            if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
                return "\0"  # matches no root
            return f"{scheme}://{posixpath.normpath('/' + rest).lstrip('/')}"
        return os.path.realpath(v)

    target = norm(value)
    if target == "\0":
        return False
    return any(target == (r := norm(root).rstrip("/")) or target.startswith(r + "/") for root in roots)
