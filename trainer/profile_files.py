"""Profiles from files and back (docs/architecture.md §2): a profile by name or path (``profiles/NAME.yaml``), with
``${VAR}`` expanded from the environment and ``--set section.key=value`` overrides applied; the resolved profile a
run records in its store, and that its job's processes read; a profile built from a mapping with one-line errors
(``build_profile``), and the same profile on fewer nodes (``with_nodes``, ``can_shrink``). The schema is
``trainer/config.py``.

Precedence: ``--set section.key=value`` > the run form's typed values > profile file > model defaults. String
values may use ``${TRAINPIPE_HOME}`` (default ``./.trainpipe``, resolved to an absolute path) and other environment
variables, so one profile works from any working directory and tests can point it at a temp folder."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from yaml.composer import ComposerError

from trainpipe.trainer import grammar
from trainpipe.trainer.config import PRIVATE_ENV, Profile, Section, StoreConfig
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.private import own_folder
from trainpipe.trainer.redact import SECRET_NAME, redact_text, secret_values

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
PROFILE_MAX_BYTES = 8 << 20  # a resolved profile is a few KB; read no more than this of one


def trainpipe_home() -> str:
    return os.path.abspath(os.environ.get("TRAINPIPE_HOME") or ".trainpipe")


def private_home() -> str:
    """TRAINPIPE_HOME, made owner-only (0700) whatever the umask: it holds the MLflow and Prefect databases, the
    servers' credentials and logs and the local store, which other local users must not read
    (docs/security.md). A folder of this user's that others could enter is narrowed; one of another user's is
    refused in one line (ProfileError)."""
    home = trainpipe_home()
    os.makedirs(os.path.dirname(home), exist_ok=True)
    if problem := own_folder(home):
        raise ProfileError(
            f"TRAINPIPE_HOME {home} {problem}: it holds this user's databases and credentials; "
            "set TRAINPIPE_HOME to a folder of your own"
        )
    return home


_VAR = re.compile(r"\$\{(\w+)\}")
# Store options known to hold no credential: the values expanded into them are shown (an endpoint in an error line)
PLAIN_STORE_OPTIONS = ("endpoint_url", "region_name", "anon", "use_ssl", "version_aware")


def _expand(value: Any, secrets: set[str], every: bool = False) -> Any:
    """``${NAME}`` replaced from the environment; the values of credential-named variables go into ``secrets``, and
    with ``every`` (inside ``store.storage_options``, where a connection string or a passphrase may hide under
    any name) the value of every variable."""
    if isinstance(value, str):
        env = {**os.environ, "TRAINPIPE_HOME": trainpipe_home()}

        def sub(m: re.Match) -> str:
            found = env.get(m.group(1))
            if found is None:
                return m.group(0)
            if every or SECRET_NAME.search(m.group(1)):
                secrets.add(found)
            return found

        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {
            k: _expand(v, secrets, (every or k == "storage_options") and k not in PLAIN_STORE_OPTIONS)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_expand(v, secrets, every) for v in value]
    return value


def known_profiles() -> list[str]:
    """The profile names that ship in profiles/ (the choices of the Prefect run form)."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def resolve_profile_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ProfileError(f"profile file {path} does not exist")
        return path
    search = [Path(os.environ["TRAINPIPE_PROFILES"])] if os.environ.get("TRAINPIPE_PROFILES") else []
    search += [Path.cwd() / "profiles", PROFILES_DIR]
    for folder in search:
        candidate = folder / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    raise ProfileError(
        f"unknown profile '{name_or_path}' (known: {', '.join(known_profiles())}); pass a name or a .yaml path"
    )


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without aliases: a profile has no use for them, and an alias loop or an alias bomb would make
    loading recurse without end or expand without bound."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ComposerError(None, None, f"aliases (*{event.anchor}) are not allowed in a profile", event.start_mark)
        return super().compose_node(parent, index)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_NoAliasLoader)


def parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ProfileError(f"--set {item!r}: expected section.key=value")
    parts = key.strip().split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ProfileError(
            f"--set {item!r}: the key must be section.key or section.key.item, e.g. train.steps=100 or "
            "launcher.slurm.partition=gpu"
        )
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    except (ValueError, RecursionError):  # an integer past Python's digit limit; nesting past the stack
        raise ProfileError(f"--set {key.strip()[:80]}: the value is too large or nested too deeply to read") from None
    return parts, value


def load_profile(
    name_or_path: str = "local", overrides: list[str] | tuple[str, ...] = (), values: Mapping[str, Any] | None = None
) -> Profile:
    """Load a profile by name or path, apply typed ``values`` (``{"train.steps": 600}``: the run form's fields, as
    they are), then ``section.key=value`` overrides, validate."""
    path = resolve_profile_path(name_or_path)
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path}: not UTF-8 text (byte {exc.start}); save the profile as UTF-8") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML ({exc.__class__.__name__}: {exc})".splitlines()[0]) from None
    except RecursionError:
        raise ProfileError(f"{path}: nested too deeply to be a profile") from None
    except ValueError as exc:  # an integer past Python's digit limit
        raise ProfileError(f"{path}: a value it holds cannot be read ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: expected a mapping of sections at the top level")
    raw.setdefault("name", path.stem)
    # ${VAR} is the operator's: expanded in the profile file only. Overrides are data (a run form's among them),
    # applied after the expansion and refused when they hold ${…}, so none can read a variable into a value.
    secrets: set[str] = set()
    raw = _expand(raw, secrets)
    sources: dict[str, str] = {}
    # (section and key, value, where it came from): the typed values first, then the overrides, applied last
    typed = [(dotted.split(".", 1), v, f"parameter {dotted}={v!r}") for dotted, v in (values or {}).items()]
    parsed = [(*parse_override(item), f"--set {_shown(item)}") for item in overrides]
    for (section, key, *item), value, origin in [*typed, *parsed]:
        if section not in Profile.model_fields or section == "name":
            known = ", ".join(section_names())
            raise ProfileError(f"{origin}: unknown section '{section}' (sections: {known})")
        if "${" in json.dumps(value, default=str):
            raise ProfileError(
                f"--set {section}.{key}: ${{…}} is expanded only in profile files, never in overrides; "
                "give the value itself"
            )
        if not set_value(raw, [section, key, *item], value):
            where = f"{section}.{key}" if item else section
            raise ProfileError(f"{origin}: {where} is not a mapping, so nothing can be set inside it")
        sources[".".join([section, key, *item])] = origin
    profile = build_profile(raw, origin=str(path), sources=sources, secrets=secrets)
    for section in Profile.model_fields:  # defaults the file left out may use ${TRAINPIPE_HOME} too
        block = getattr(profile, section)
        for key in type(block).model_fields if isinstance(block, Section) else ():
            if key in block.model_fields_set:
                continue  # from the file (expanded once, above) or an override (never expanded)
            if isinstance(value := getattr(block, key), str) and "${" in value:
                try:
                    setattr(block, key, _expand(value, secrets))
                except ValidationError as exc:  # an expanded default the section's checks refuse
                    message = exc.errors()[0]["msg"].removeprefix("Value error, ")
                    raise ProfileError(f"{path}: {section}.{key}: {message}") from None
    return profile.with_secrets(secrets)


def set_value(raw: dict[str, Any], parts: list[str], value: Any) -> bool:
    """``raw[a][b]... = value`` along ``parts``, making the mappings on the way; False when one on the way is not
    a mapping."""
    block = raw
    for part in parts[:-1]:
        block = block.setdefault(part, {})
        if not isinstance(block, dict):
            return False
    block[parts[-1]] = value
    return True


def _shown(item: str) -> str:
    """An override as an error line shows it: escaped when it holds a control character (one line stays one),
    without URL user-info."""
    item = redact_text(item)  # a URL's password, refused a line later, is not shown either
    return repr(item) if grammar.CONTROL.search(item) else item


def profile_from_yaml(text: str) -> Profile:
    """Rebuild a resolved profile (as written by ``Profile.to_yaml``)."""
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"<resolved profile>: not valid YAML ({exc})".splitlines()[0]) from None
    except (ValueError, RecursionError):  # from the store, which others may write: a huge integer, deep nesting
        raise ProfileError("<resolved profile>: a value is too large or nested too deeply to read") from None
    if not isinstance(raw, dict):
        raise ProfileError("<resolved profile>: expected a mapping of sections at the top level")
    return build_profile(raw, origin="<resolved profile>")


def load_resolved_profile(uri: str, storage_options: dict[str, Any] | None = None) -> Profile:
    """Read a resolved profile from a path or URI (how the ranks receive their configuration)."""
    from trainpipe.trainer.store import filesystem, open_binary

    fs, path = filesystem(uri, storage_options)
    with open_binary(fs, path) as fh:
        body = fh.read(PROFILE_MAX_BYTES + 1)
    if len(body) > PROFILE_MAX_BYTES:
        raise ProfileError(f"{uri}: more than {PROFILE_MAX_BYTES} bytes, too large to be a profile")
    try:
        return with_private_env(profile_from_yaml(body.decode("utf-8")))
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{uri}: not UTF-8 text (byte {exc.start})") from None


def with_private_env(profile: Profile) -> Profile:
    """In a job's process: the store settings (credentials included) its launcher passed in the environment."""
    if private := os.environ.get(PRIVATE_ENV):
        body = json.loads(private)
        profile.store = StoreConfig.model_validate(body["store"])
        profile.with_secrets(set(body["secrets"]))
    return profile


def write_resolved_profile(profile: Profile, run_name: str) -> str:
    """Write ``{store}/runs/{run}/profile.yaml``: the record of what the run trains with (credentials redacted)."""
    from trainpipe.trainer.store import filesystem, write_text
    from trainpipe.trainer.store_paths import RunPaths

    uri = RunPaths(profile.store.root, run_name).profile
    fs, path = filesystem(uri, profile.store.storage_options)
    write_text(fs, path, profile.public_yaml())
    return uri


def section_names() -> list[str]:
    return [k for k in Profile.model_fields if k != "name"]


def build_profile(
    raw: dict[str, Any],
    origin: str = "<dict>",
    sources: dict[str, str] | None = None,
    secrets: set[str] | frozenset[str] = frozenset(),
) -> Profile:
    try:
        profile = Profile.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        # a key is the file's (or a manifest's, from the store): quoted when it holds what would break the line
        loc = ".".join(repr(p)[:80] if grammar.control_problem(str(p)) else str(p)[:80] for p in err["loc"])
        where = (sources or {}).get(loc, origin)
        # The value is shown to help; never a credential (a store option, a URL's password, an expanded secret).
        hidden = loc.startswith("store.storage_options") or isinstance(err.get("input"), dict)
        shown = "" if hidden else f" (got {err.get('input')!r})"
        shown = redact_text(shown, {*secrets, *secret_values(raw.get("store", {}) if isinstance(raw, dict) else {})})
        if err["type"] == "extra_forbidden":
            section = str(err["loc"][0])
            if len(err["loc"]) == 1:
                msg = f"unknown section '{loc}' (sections: {', '.join(section_names())})"
            else:
                allowed = ", ".join(Profile.model_fields[section].annotation.model_fields)  # type: ignore[union-attr]
                msg = f"unknown key '{loc}' (keys of {section}: {allowed})"
        elif not loc:
            msg = err["msg"].removeprefix("Value error, ")
        else:
            msg = f"{loc}: {err['msg'].removeprefix('Value error, ')}{shown}"
        raise ProfileError(f"{where}: {msg}") from None
    return profile


def with_nodes(profile: Profile, nodes: int, why: str) -> Profile:
    """The same profile on ``nodes`` nodes (after exclusions), validated again."""
    body = profile.model_dump(mode="json", by_alias=True)
    body["cluster"]["nodes"] = nodes
    return build_profile(body, origin=why).with_secrets(profile._secrets)


def can_shrink(profile: Profile) -> bool:
    """Whether the profile still holds on fewer nodes, down to cluster.min_nodes (a layout's sizes, the virtual
    ranks and the global batch must fit the smaller world), so a node can be left out."""
    for n in range(profile.cluster.nodes - 1, profile.cluster.min_nodes - 1, -1):
        try:
            with_nodes(profile, n, "a shrink")
            return True
        except ProfileError:
            continue
    return False
