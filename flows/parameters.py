"""The pipeline's parameters: one pydantic model, which the Prefect UI renders as the run form.

The typed fields are the overrides people change most, with bounds the server
checks against the deployment's schema before a flow run exists; anything else
goes through ``overrides`` (``section.key=value``), applied last. No credential
is a parameter: flow-run parameters are stored and shown in clear by Prefect,
so store and tracking secrets come from the environment (docs/security.md).

Light on purpose (pydantic only): the CLI builds one before Prefect is imported.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainpipe.trainer.config import Profile
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.profile_files import known_profiles, resolve_profile_path
from trainpipe.trainer.store_paths import RUN_NAME_PATTERN

OVERRIDE_PATTERN = r"^[a-z_]+\.[a-z_]+(\.[a-z0-9_]+)?=.*$"  # section.key, or section.key.item
# Keys named like a secret, and those that hold or lead to credentials: the store's options and the tracking URI
# (which may carry a password), item by item too.
_SECRET_NAME = re.compile(r"(^|[._])(\w*_)?(key|apikey|secret|token|password|passwd|pwd|auth|credentials?)(_|$)", re.I)
_CREDENTIAL_HOLDERS = re.compile(r"^(store\.storage_options|tracking\.tracking_uri)(\.|$)")
_USERINFO = re.compile(r"://[^/@\s]+@")  # a URL with a user or password in it


def refuse_credentials(overrides: list[str], stored: bool = True) -> list[str]:
    """``overrides`` if each is ``section.key=value`` with no credential in it; else ProfileError naming the key.

    Every flow's parameters are stored and shown in clear by Prefect, and a command line is visible to every
    local user: credentials come from the environment instead. ``stored=False`` (a command that starts no flow:
    ``models``, ``compare``, ``ckpt``): the store's options and the tracking URI may be named, without a
    credential in them."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        if not re.match(OVERRIDE_PATTERN, item.strip()):
            raise ProfileError(f"{item!r} is not section.key=value")
        if _SECRET_NAME.search(key) or (stored and _CREDENTIAL_HOLDERS.match(key)) or _USERINFO.search(item):
            raise ProfileError(
                f"{key} cannot be set as a parameter: parameters are stored in clear; "
                "set credentials and endpoints in the environment (AWS_*, MLFLOW_TRACKING_URI)"
            )
    return overrides


class PipelineParameters(BaseModel):
    """What to train: a profile, the settings most often changed, and which run it is."""

    # The form shows each typed field prefilled with the served profile's value (``form_schema``); left as it is,
    # or None through the API and the CLI, a field takes the chosen profile's own value (``profile_values``).

    model_config = ConfigDict(extra="forbid", json_schema_extra={"title": "trainpipe run"})

    profile: str = Field(
        default="local",
        title="Profile",
        description="Run profile: a file in profiles/ (the CLI also accepts a path to a YAML file).",
        json_schema_extra={"enum": [*known_profiles()]},
    )
    run_name: str | None = Field(
        default=None,
        title="Run name",
        description="Name of this run (letters, digits, . _ -). Empty: the Run Name at the top of the form (a "
        "scheduled run: the profile's name and the time); given, this one wins. "
        "Reusing a name continues that run from its last committed checkpoint.",
        pattern=RUN_NAME_PATTERN,
    )
    resume: str | None = Field(
        default=None,
        title="Resume run",
        description="Continue this earlier run from its last committed checkpoint; it must exist. "
        "Takes the place of run name.",
        pattern=RUN_NAME_PATTERN,
    )
    steps: int | None = Field(
        default=None, title="Steps", description="Optimizer steps in total.", ge=1, le=100_000_000
    )
    lr: float | None = Field(default=None, title="Learning rate", description="Peak learning rate.", gt=0, le=10)
    global_batch: int | None = Field(
        default=None,
        title="Global batch",
        description="Sequences per optimizer step across all ranks; a multiple of micro batch × world size.",
        ge=1,
        le=1_000_000,
    )
    seed: int | None = Field(
        default=None, title="Seed", description="Seed for init and data order.", ge=0, le=2**32 - 1
    )
    procs_per_node: int | None = Field(
        default=None, title="Processes per node", description="Worker processes (GPUs) per node.", ge=1, le=64
    )
    checkpoint_every: int | None = Field(
        default=None, title="Checkpoint every", description="Commit a checkpoint every N steps.", ge=1, le=10_000_000
    )
    max_retries: int | None = Field(
        default=None, title="Retries", description="Training attempts after the first, each resuming.", ge=0, le=20
    )
    preflight: bool | None = Field(default=None, title="Preflight", description="Check the cluster before training.")
    overrides: list[str] = Field(
        default_factory=list,
        title="Other overrides",
        description="More profile fields as section.key=value, applied last, e.g. model.n_layer=6: only keys the "
        "profile's deploy.overridable lists. Values are taken as they are (no ${VAR}); credentials are refused.",
        json_schema_extra={"items": {"type": "string", "pattern": OVERRIDE_PATTERN}},
    )

    _TYPED: ClassVar[dict[str, str]] = {
        "steps": "train.steps",
        "lr": "train.lr",
        "global_batch": "train.global_batch",
        "seed": "train.seed",
        "procs_per_node": "cluster.procs_per_node",
        "checkpoint_every": "checkpoint.every_steps",
        "max_retries": "train.max_retries",
        "preflight": "preflight.enabled",
    }

    @field_validator("run_name", "resume", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value  # the run form's empty text box

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        try:
            resolve_profile_path(value)
        except ProfileError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("lr")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("overrides")
    @classmethod
    def _no_credentials(cls, items: list[str]) -> list[str]:
        try:
            return refuse_credentials(items)
        except ProfileError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _one_name(self) -> PipelineParameters:
        if self.run_name and self.resume and self.run_name != self.resume:
            raise ValueError(f"run_name {self.run_name!r} and resume {self.resume!r} disagree; give one")
        return self

    def check_override_bounds(self) -> None:
        """ProfileError unless each free-form override of a key the form has a typed field for (``train.steps``)
        keeps within that field's bounds: an override is not a way around them."""
        from pydantic import ValidationError

        from trainpipe.trainer.profile_files import parse_override

        typed = {key: field for field, key in self._TYPED.items()}
        for item in self.overrides:
            parts, value = parse_override(item)
            section, key = parts[0], parts[1]
            if len(parts) > 2 or (field := typed.get(f"{section}.{key}")) is None:  # an item: no typed field
                continue
            try:
                type(self).model_validate({"profile": self.profile, field: value})
            except ValidationError as exc:
                message = exc.errors()[0]["msg"].removeprefix("Value error, ")
                title = type(self).model_fields[field].title
                raise ProfileError(f"{section}.{key}={value!r}: {message} (the form's {title} field)") from None

    @property
    def name(self) -> str | None:
        """The run this request names, if it names one."""
        return self.resume or self.run_name

    def profile_values(self, served: dict[str, Any] | None = None) -> dict[str, Any]:
        """The typed fields that are set, as the profile keys they set and their values as they are (no round trip
        through ``key=value`` text); the free-form ``overrides`` are applied after them. ``served``: the run
        form's defaults (the served profile's values, what `trainpipe serve` resolved). When the form chose
        another profile, a field left at its default is not set: the chosen profile's own value applies."""
        served = served or {}
        switched = served.get("profile", self.profile) != self.profile
        return {
            key: value
            for field, key in self._TYPED.items()
            if (value := getattr(self, field)) is not None and not (switched and served.get(field) == value)
        }


def form_values(profile: Profile) -> dict[str, Any]:
    """The typed fields' values in ``profile``: what the run form shows when it serves that profile. A value
    outside its field's bounds (a profile may allow ``train.max_retries: 30``) is left out: that box starts
    empty, and left empty the profile's own value applies."""
    from pydantic import ValidationError

    out = {}
    for field, key in PipelineParameters._TYPED.items():
        section, name = key.split(".")
        value = getattr(getattr(profile, section), name)
        try:
            PipelineParameters.model_validate({field: value})
        except ValidationError:
            continue
        out[field] = value
    return out


def form_schema(schema: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The deployment's parameter schema as the run form renders it: each typed field a plain box of its type
    (not a choice between the type and None) prefilled with ``values``, its bounds in its description; the run
    names plain text boxes, empty by default. The server checks a submitted value against these bounds."""
    props = schema["definitions"]["PipelineParameters"]["properties"]
    for field in [*values, "run_name", "resume"]:  # a typed field without a value keeps its empty (None) choice
        prop = props[field]
        plain = next(branch for branch in prop.pop("anyOf") if branch.get("type") != "null")
        prop.update(plain)
        if field in values:
            prop["default"] = values[field]
            prop["description"] += _bounds(prop)
        else:
            prop["default"] = ""
            prop["pattern"] = f"^$|{prop['pattern']}"
    return schema


def _bounds(prop: dict[str, Any]) -> str:
    """`` Allowed: 1 to 64.``: a field's bounds as its description says them."""
    low = f"{prop['minimum']:,}" if "minimum" in prop else None
    if "exclusiveMinimum" in prop:
        low = f"above {prop['exclusiveMinimum']:,}"
    high = f"{prop['maximum']:,}" if "maximum" in prop else None
    if low and high:
        return f" Allowed: {low} to {high}."
    return f" Allowed: at least {low}." if low else (f" Allowed: at most {high}." if high else "")
