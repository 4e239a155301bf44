"""Where a corpus comes from: the files a ``data.source`` spec names, locally or through fsspec.

Light on purpose (no torch): the CLI checks a source with it before anything
else starts.
"""

from __future__ import annotations

import glob
import os
import posixpath
import sysconfig
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from trainer.config import DataConfig, StoreConfig
from trainer.errors import DataError

STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})


def _glob_base(pattern: str) -> str:
    """The folder above the first wildcard: document names are relative to it, so the
    same corpus gives the same dataset_id wherever it lives."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if glob.has_magic(part):
            return "/".join(parts[:i])
    return posixpath.dirname(pattern)


def list_source(source: str, storage_options: dict | None) -> tuple[Any, list[tuple[str, str]]]:
    """(filesystem, sorted [(name, path)]) of the files a ``data.source`` spec names."""
    if source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        paths = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDE]
            paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
        fs, base = LocalFileSystem(), root
    elif "://" not in source:
        pattern = os.path.expanduser(source)
        if os.path.isdir(pattern):
            pattern = os.path.join(pattern, "**", "*")
        paths = [os.path.abspath(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        fs, base = LocalFileSystem(), os.path.abspath(_glob_base(pattern) or ".")
    else:
        try:
            fs, pattern = url_to_fs(source, **(storage_options or {}))
            if not glob.has_magic(pattern) and fs.isdir(pattern):
                pattern = pattern.rstrip("/") + "/**"
            found = fs.glob(pattern, detail=True)
        except FileNotFoundError:
            found = {}
        except (ImportError, ValueError, OSError) as exc:
            raise DataError(f"cannot list data.source {source!r} ({exc.__class__.__name__}: {exc})") from None
        paths = [p for p, info in found.items() if info.get("type") == "file"]
        base = _glob_base(pattern)
    files = []
    for path in sorted(paths):
        name = (
            os.path.relpath(path, base).replace(os.sep, "/")
            if isinstance(fs, LocalFileSystem)
            else path[len(base) :].lstrip("/")
        )
        files.append((name, path))
    return fs, files


def check_source(data: DataConfig, store: StoreConfig) -> int:
    """Number of files ``data.source`` matches; DataError when none, so a bad source fails before any work."""
    _, files = list_source(data.source, source_options(data.source, store))
    if not files:
        raise DataError(
            f"data.source {data.source!r} matched no files; "
            "check the path/glob (use ** for subfolders) and that files exist"
        )
    return len(files)


def source_options(source: str, store: StoreConfig) -> dict:
    # DataConfig has no credentials of its own: a source on the store's protocol
    # (e.g. the same S3 endpoint) uses the store's storage_options.
    if "://" in source and store.root.startswith(source.split("://", 1)[0] + "://"):
        return store.storage_options
    return {}
