"""Folders only their owner may enter (docs/security.md): TRAINPIPE_HOME, the servers' folder, a Slurm run's job
folder. Light on purpose (the standard library only): the CLI calls it before anything else is imported."""

from __future__ import annotations

import contextlib
import os
import stat


def own_folder(path: str, follow_links: bool = True) -> str | None:
    """Make ``path`` (mode 0700, whatever the umask) unless it is there; then None when it is a folder of this user's,
    narrowed to its owner if others could enter it, else what it is instead ("belongs to uid N", "is not a folder"):
    a folder another user made first, in a place both may write, would let them read or swap what goes in."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.stat(path) if follow_links else os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder" + ("" if follow_links else " (a link?)")
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}"
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return None
