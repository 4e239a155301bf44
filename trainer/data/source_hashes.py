"""The sha256 of source segments this machine hashed before, by what the file's stat said then, so that the find
pass over a grown corpus reads only the files that changed (docs/architecture.md §3, "The find pass").

A local file's ``version`` (sources.py) is its device, inode, size, mtime and ctime, taken when the source was
listed, and only when its ctime is older than the listing by ``sources.SETTLED_NS``: any write afterwards moves
the ctime forward (a program can set a file's mtime back, never its ctime), so a file whose version is what it was
when its bytes were hashed holds those bytes. A file changed within SETTLED_NS of the listing has no version and
is hashed, as git treats a "racily clean" index entry. Kept in an SQLite file in the owner-only TRAINPIPE_HOME,
never in the store: another user, or anyone who can write the bucket, cannot plant a hash. A cache that cannot be
read or written is one warning, and every file is hashed as without it; ``verify`` does not consult it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator

from trainpipe.trainer.data.sources import Segment

FILE = "source-hashes.sqlite"


def cache_path(home: str) -> str:
    return os.path.join(home, FILE)


def _key(seg: Segment) -> str:
    return json.dumps([seg.file.path, seg.file.kind, seg.start, seg.stop, seg.hard])


class SourceHashes:
    """Segment hashes by (path, range) with the version of the file they were read from."""

    def __init__(self, path: str, warn: Callable[[str], None]):
        self.path, self.warn, self.db = path, warn, None
        try:
            self.db = sqlite3.connect(path, timeout=10)
            os.chmod(path, 0o600)
            self.db.execute("CREATE TABLE IF NOT EXISTS hashes (key TEXT PRIMARY KEY, version TEXT, sha256 TEXT)")
        except (sqlite3.Error, OSError) as exc:
            self._broken(exc)

    def _broken(self, exc: Exception) -> None:
        self.warn(
            f"source hash cache {self.path} not usable ({exc.__class__.__name__}: {exc}); every file is hashed "
            "(delete the file to start it afresh)"
        )
        if self.db is not None:
            with contextlib.suppress(sqlite3.Error):
                self.db.close()
        self.db = None

    def known(self, segments: Iterable[tuple[int, Segment]]) -> dict[int, str]:
        """The hash of each segment (by its number) whose file still has the version it had when hashed."""
        wanted = [(i, seg, _key(seg)) for i, seg in segments if seg.file.version]
        if self.db is None or not wanted:
            return {}
        out = {}
        try:
            for i, seg, key in wanted:
                row = self.db.execute("SELECT version, sha256 FROM hashes WHERE key = ?", (key,)).fetchone()
                if row is not None and row[0] == seg.file.version:
                    out[i] = row[1]
        except sqlite3.Error as exc:
            self._broken(exc)
            return {}
        return out

    def remember(self, hashed: Iterable[tuple[Segment, str]]) -> None:
        """Each segment's hash under its file's version at listing (segments without one are passed over)."""
        rows = [(_key(seg), seg.file.version, sha) for seg, sha in hashed if seg.file.version]
        if self.db is None or not rows:
            return
        try:
            with self.db:
                self.db.executemany("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?)", rows)
        except sqlite3.Error as exc:
            self._broken(exc)

    def close(self) -> None:
        if self.db is not None:
            self.db.close()


@contextlib.contextmanager
def opened(path: str | None, warn: Callable[[str], None]) -> Iterator[SourceHashes | None]:
    """The cache at ``path``; None (hash everything) without one."""
    if path is None:
        yield None
        return
    cache = SourceHashes(path, warn)
    try:
        yield cache
    finally:
        cache.close()
