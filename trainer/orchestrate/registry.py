"""MLflow's Model Registry as the publish stage uses it (docs/architecture.md §11): one registered model per
profile, a version per published checkpoint tagged with its lineage, the aliases ``candidate`` and ``champion``.

Every registry call goes through ``Registry._call``: an error becomes one ``PublishError`` line without the
server's credentials. The registry is shared state; a name reaches it only as a value of MLflow's API (never in
a filter string unquoted: names with quotes are refused by the profile's grammar).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from trainpipe.trainer.errors import PublishError
from trainpipe.trainer.redact import redact_text, url_secrets
from trainpipe.trainer.tracking import client

CANDIDATE, CHAMPION = "candidate", "champion"
TAG = "trainpipe."  # every lineage tag of a version
T = TypeVar("T")
_FLUENT = threading.Lock()  # mlflow's fluent API reads one process-wide tracking URI


@contextlib.contextmanager
def fluent(uri: str) -> Iterator[None]:
    """mlflow's fluent API pointed at ``uri`` for one call: ``mlflow.transformers.log_model`` has no client. The
    URIs and the environment variables ``set_*_uri`` writes (which subprocesses inherit) are put back exactly as
    they were, unset included: a resolved default written back would send every later client to ./mlflow.db."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    with _FLUENT:
        saved = tracking_utils._tracking_uri, registry_utils._registry_uri
        env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(saved[0])
            registry_utils._registry_uri = saved[1]
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@dataclass(frozen=True)
class VersionView:
    """A registered model's version as ``trainpipe models list`` shows it."""

    name: str
    version: str
    aliases: list[str]
    run: str
    val_loss: str
    created_ms: int
    model_id: str
    gate: str
    tags: dict[str, str]

    def line(self) -> str:
        aliases = ",".join(self.aliases) or "-"
        return f"{self.name} v{self.version:<4} {aliases:<20} run {self.run or '-':<32} val loss {self.val_loss or '-'}"


class Registry:
    """The Model Registry of the MLflow server or store at ``tracking_uri``."""

    def __init__(self, tracking_uri: str):
        self.uri = tracking_uri
        self.client = client(tracking_uri)

    def _error(self, what: str, exc: BaseException) -> PublishError:
        first = redact_text((str(exc).splitlines() or [""])[0][:300], url_secrets(self.uri)).rstrip(". ")
        return PublishError(f"the model registry at {redact_text(self.uri)} refused to {what}: {first}")

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - MLflow raises its own, requests' and SQLAlchemy's errors
            raise self._error(what, exc) from None

    def ensure_model(self, name: str) -> None:
        """The registered model ``name``, created when it does not exist yet."""
        try:
            self.client.get_registered_model(name)
            return
        except Exception as exc:  # noqa: BLE001 - absent is expected; anything else is one line
            if getattr(exc, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                raise self._error(f"read registered model {name!r}", exc) from None
        self._call(
            f"create registered model {name!r}",
            self.client.create_registered_model,
            name,
            description="Published by trainpipe: one version per validated checkpoint, 'champion' moved by its gate.",
        )

    def version_of(self, name: str, run_id: str, digest: str) -> Any | None:
        """The version of ``name`` that run ``run_id`` published with these weights, if it did."""
        found = self._call(
            f"search the versions of {name!r}",
            self.client.search_model_versions,
            filter_string=f"name = '{name}' and run_id = '{run_id}'",
        )
        return next((v for v in found if v.tags.get(f"{TAG}model_digest") == digest), None)

    def by_alias(self, name: str, alias: str) -> Any | None:
        """The version ``alias`` points at; None when the model or the alias does not exist."""
        try:
            return self.client.get_model_version_by_alias(name, alias)
        except Exception as exc:  # noqa: BLE001 - absent is expected; anything else is one line
            if getattr(exc, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise self._error(f"read alias {alias!r} of {name!r}", exc) from None

    def version(self, name: str, version: str) -> Any:
        return self._call(f"read version {version} of {name!r}", self.client.get_model_version, name, version)

    def register(self, name: str, run_id: str, model_id: str, tags: dict[str, str]) -> Any:
        """A new version of ``name`` from the logged model ``model_id``, its source the model's artifact location."""
        self.ensure_model(name)
        model = self._call("read the logged model", self.client.get_logged_model, model_id)
        with fluent(self.uri):
            return self._call(
                f"register a version of {name!r}",
                self.client.create_model_version,
                name,
                source=model.artifact_location,
                run_id=run_id,
                tags=tags,
                model_id=model_id,
            )

    def tag(self, name: str, version: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self._call(
                f"tag version {version} of {name!r}", self.client.set_model_version_tag, name, version, key, value
            )

    def move_alias(self, name: str, alias: str, version: str) -> None:
        self._call(f"move alias {alias!r} of {name!r}", self.client.set_registered_model_alias, name, alias, version)

    def versions(self, name: str) -> list[VersionView]:
        try:
            model = self.client.get_registered_model(name)
        except Exception as exc:  # noqa: BLE001 - absent: no versions; anything else is one line
            if getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
                return []
            raise self._error(f"read registered model {name!r}", exc) from None
        found = self._call(
            f"list the versions of {name!r}", self.client.search_model_versions, filter_string=f"name = '{name}'"
        )
        aliases: dict[str, list[str]] = {}  # a search's versions carry no aliases; the registered model has them
        for alias, version in model.aliases.items():
            aliases.setdefault(str(version), []).append(alias)
        views = [
            VersionView(
                name=name,
                version=str(v.version),
                aliases=sorted(aliases.get(str(v.version), [])),
                run=v.tags.get(f"{TAG}run", ""),
                val_loss=v.tags.get(f"{TAG}val_loss", ""),
                created_ms=int(v.creation_timestamp or 0),
                model_id=str(getattr(v, "model_id", "") or ""),
                gate=v.tags.get(f"{TAG}gate", ""),
                tags=dict(v.tags),
            )
            for v in found
        ]
        return sorted(views, key=lambda v: int(v.version), reverse=True)


def lineage_tags(**values: Any) -> dict[str, str]:
    """``trainpipe.KEY`` tags of a version: strings, a mapping as JSON."""
    return {f"{TAG}{k}": v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in values.items()}


def code_version() -> str:
    """The commit trainpipe runs from (read from .git, no git process), else its installed version."""
    root = Path(__file__).resolve().parents[2]  # the checkout, when trainpipe runs from one
    git = root / ".git"
    with contextlib.suppress(OSError, ValueError):
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            loose = git / ref
            if loose.is_file():
                return f"git:{loose.read_text().strip()}"
            for line in (git / "packed-refs").read_text().splitlines():
                if line.endswith(f" {ref}"):
                    return f"git:{line.split()[0]}"
        elif len(head) == 40:
            return f"git:{head}"
    return f"trainpipe=={importlib.metadata.version('trainpipe')}"
