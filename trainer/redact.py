"""Credentials out of what trainpipe records and shows (DESIGN §9).

A profile's recorded form (``Profile.public``: the store's ``profile.yaml``,
MLflow params and artifacts, checkpoint manifests) and the lines trainpipe
prints pass through here. Three things are hidden: any value under a key named
like a credential inside the free-form ``store.storage_options`` (at any
depth), the user-info of any URL (``scheme://user:password@host``), and every
value that came from an environment variable named like a credential
(``${AWS_SECRET_ACCESS_KEY}``) or sat under such a key, wherever it reappears.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

REDACTED = "<redacted>"
SECRET_NAME = re.compile(r"key|secret|token|password|passwd|credential|session|auth", re.IGNORECASE)
MIN_SECRET_LEN = 8  # shorter values are not credentials, and hiding them would garble unrelated text
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without URL user-info or any of ``secrets``."""
    text = _USERINFO.sub(rf"\1{REDACTED}@", text)
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= MIN_SECRET_LEN:
            text = text.replace(secret, REDACTED)
    return text


def redact(value: Any, secrets: Iterable[str] = (), by_key: bool = False) -> Any:
    """A copy of a JSON-like ``value`` with every string redacted; with ``by_key``, values under keys named like
    credentials are replaced whole (for free-form option dicts, where any key may hold one)."""
    secrets = tuple(secrets)
    if isinstance(value, dict):
        return {
            k: REDACTED if by_key and SECRET_NAME.search(str(k)) else redact(v, secrets, by_key)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v, secrets, by_key) for v in value]
    if isinstance(value, str):
        return redact_text(value, secrets)
    return value


def secret_values(value: Any) -> set[str]:
    """The string values under credential-named keys anywhere in ``value`` (to hide them wherever else they
    reappear)."""
    found: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            if SECRET_NAME.search(str(k)) and isinstance(v, str):
                found.add(v)
            else:
                found |= secret_values(v)
    elif isinstance(value, list | tuple):
        for v in value:
            found |= secret_values(v)
    return {v for v in found if len(v) >= MIN_SECRET_LEN}
