"""Credentials out of what trainpipe records and shows (docs/security.md).

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
from urllib.parse import unquote

from trainpipe.trainer.grammar import userinfo

REDACTED = "<redacted>"
SECRET_NAME = re.compile(
    r"key|secret|token|password|passwd|passphrase|credential|session|auth|connection_?string|sas|signature|private",
    re.IGNORECASE,
)
MIN_SECRET_LEN = 8  # shorter values are not credentials, and hiding them would garble unrelated text
# A URL as it sits in text: its scheme, then everything up to a blank or a quote (a password may hold '/' or '@').
_URL = re.compile(r"""([A-Za-z][A-Za-z0-9+.-]*://)([^\s'"`]*)""")


def _without_userinfo(m: re.Match) -> str:
    scheme, rest = m.group(1), m.group(2)
    info = userinfo(scheme + rest)
    return scheme + rest if info is None else f"{scheme}{REDACTED}{rest[len(info) :]}"


def without_userinfo(url: str) -> str:
    """``url`` with its user-info (and the ``@`` that ends it) left out."""
    info = userinfo(url)
    if info is None:
        return url
    scheme_end = url.index("://") + 3
    return url[:scheme_end] + url[scheme_end + len(info) + 1 :]


def url_secrets(url: str) -> set[str]:
    """The password of a URL's user-info, as written and percent-decoded: values to hide wherever they reappear."""
    info = userinfo(url)
    if info is None or ":" not in info:
        return set()
    password = info.split(":", 1)[1]
    return {v for v in (password, unquote(password)) if len(v) >= MIN_SECRET_LEN}


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without URL user-info or any of ``secrets``."""
    text = _URL.sub(_without_userinfo, text)
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
