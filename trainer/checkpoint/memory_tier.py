"""The memory tier's folder: a private folder in this host's shared memory that outlives the ranks.

A checkpoint in the object store costs seconds; a snapshot into host memory
costs a copy. The ranks save their snapshots (``checkpoint.memory_every_steps``)
with the same checkpointer, commit and proof as the store's checkpoints, into a
folder on ``/dev/shm`` (tmpfs: memory, not disk). The supervisor's side opens
the folder for a run's attempts (``keep_memory``, inside
``trainer.launch.warm_attempts``) and removes it when they end, so a rank that
crashes leaves its last snapshots behind for the retry, and nothing outlives the
run (a folder left by a supervisor that was killed is removed by the next
``keep_memory`` on the host: ``remove_orphans``; one a replaced held job left
behind is taken up for its run by the next job's host there: ``adopt_orphaned``). The ranks learn the folder
from ``MEMORY_ENV`` and use it only when it is one no other local user can
reach (``private_folder``): a snapshot from there is still checked by its
manifest's hashes and its state proof before it loads (docs/architecture.md §4,
docs/security.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, TypeVar

from trainpipe.trainer.proc import pid_alive

log = logging.getLogger("trainpipe.checkpointer")

MEMORY_ENV = "TRAINPIPE_MEMORY_TIER"  # the folder of this run's attempts' memory tier (set by the supervisor)
SHARED_MEMORY = "/dev/shm"  # tmpfs on Linux: files there are pages of host memory
SNAPSHOTS_KEPT = 2  # per run: the newest, and the one before it while the newest is being written

PREFIX = "trainpipe-memory-"
LOCK = ".lock"  # flocked by the process that opened the folder for as long as its block lasts

_scope: list[str] = []
_left: set[str] = set()  # folders whose block leaves them behind (leave_behind)
LEFT = ".left"  # in a folder left behind: until when (epoch seconds) the run's next job may take it up
LEFT_FOR_S = 900.0  # a replacing job's wait in the queue, within reason; after it the folder is an orphan as any


class MemoryTierUnavailable(RuntimeError):
    """The memory tier's folder cannot be used; the run goes on with the store alone."""


@contextlib.contextmanager
def keep_memory(enabled: bool = True, base: str = SHARED_MEMORY, adopt: str | None = None) -> Iterator[str | None]:
    """A private folder under ``base`` for the attempts inside this block (its path, or None when ``enabled``
    is false or ``base`` cannot hold one: said once), removed with everything in it when the block ends. With
    ``adopt`` (a run's ``run_key``), that run's snapshots in a folder whose opener died (a held job that was
    replaced) move into the new folder first (``adopt_orphaned``); every other orphan is removed."""
    if not enabled:
        remove_orphans(base)  # a tier left behind is freed by the next run on the host, whether it keeps one
        yield None
        return
    try:
        # mkdtemp: a name no one can guess, created exclusively, mode 0700. /dev/shm is sticky, so another user
        # can neither remove nor rename it. The name carries this process's pid (remove_orphans).
        path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base)
    except OSError as exc:
        remove_orphans(base)
        log.warning("no memory tier: cannot make a folder in %s (%s); checkpoints go to the store alone", base, exc)
        yield None
        return
    lock = os.open(os.path.join(path, LOCK), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # before looking at the orphans: this folder is never one
    if adopt is not None:
        adopt_orphaned(base, adopt, path)
    remove_orphans(base)
    _scope.append(path)
    try:
        yield path
    finally:
        _scope.remove(path)
        if path in _left:
            _left.discard(path)
            with contextlib.suppress(OSError):
                _write_private(os.path.join(path, LEFT), f"{time.time() + LEFT_FOR_S:.0f}")
        else:
            shutil.rmtree(path, ignore_errors=True)
        os.close(lock)  # an orphan now, whether removed or left: the next keep_memory on the host decides


def leave_behind(path: str) -> None:
    """Leave ``path`` (an open ``keep_memory`` folder) in place when its block ends, marked ``LEFT`` for
    ``LEFT_FOR_S``: a job that replaces this one adopts its run's snapshots within that time
    (``adopt_orphaned``), and the first ``keep_memory`` on the host after it removes the folder."""
    _left.add(path)


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _left_until(folder: str) -> float:
    """Until when ``folder`` was left for its run's next job (0 when it was not: a folder whose opener died)."""
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(os.path.join(folder, LEFT), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return float(f.read(32).decode("ascii"))
    return 0.0


def adopt_orphaned(base: str, key: str, into: str) -> str | None:
    """Move run ``key``'s subfolder from the newest orphan under ``base`` that holds one and was left for the run's
    next job (``leave_behind``, not yet expired; a folder of this user's whose opener died: ``remove_orphans``'s
    rule, its lock held meanwhile) into the folder ``into``, then remove that orphan; the orphan, or None. A held
    job replaced after a lost host starts on its surviving hosts with what they held (their ranks' snapshots and
    their copies of the lost host's); each is checked as any snapshot before it loads. Only a real folder owned by
    this user, in an orphan closed to others, is taken, never a link; never a folder whose opener was killed (a
    run's earlier branch or an earlier run of the name)."""
    found: list[tuple[float, str]] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            if entry.path != into and _ours(entry):
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(entry.path, key))
                    closed = not os.lstat(entry.path).st_mode & 0o077  # as mkdtemp made it: no one else got in
                    left = _left_until(entry.path) > time.time()
                    if left and closed and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                        found.append((st.st_mtime, entry.path))
    for _, orphan in sorted(found, reverse=True):
        pid = int(os.path.basename(orphan).removeprefix(PREFIX).split("-", 1)[0])
        with contextlib.suppress(OSError), _unless_held(orphan, pid) as gone:
            if gone:
                os.rename(os.path.join(orphan, key), os.path.join(into, key))
                shutil.rmtree(orphan, ignore_errors=True)
                log.info("kept this run's memory-tier snapshots from %s, whose job ended", orphan)
                return orphan
    return None


def _ours(entry: os.DirEntry) -> bool:
    """Whether ``entry`` is a memory-tier folder (by its name) that this user owns."""
    pid = entry.name.removeprefix(PREFIX).split("-", 1)[0]
    if not entry.name.startswith(PREFIX) or not pid.isdigit():
        return False
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def remove_orphans(base: str = SHARED_MEMORY) -> list[str]:
    """Remove the memory-tier folders under ``base`` that this user's processes opened and that outlived them (a
    supervisor killed before its block ended: tmpfs holds memory until someone deletes the files); return them.
    Another user's folders, and those whose lock a process still holds, are left alone: the kernel drops a
    process's flock when it dies, in whatever pid namespace (a container sharing /dev/shm) it ran. A folder
    without a lock is judged by the pid in its name. A folder left for a run's next job (``leave_behind``) is
    spared until its time is up."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            if not _ours(entry):
                continue
            pid = entry.name.removeprefix(PREFIX).split("-", 1)[0]
            with contextlib.suppress(OSError), _unless_held(entry.path, int(pid)) as orphan:
                if orphan and _left_until(entry.path) <= time.time():
                    shutil.rmtree(entry.path)
                    removed.append(entry.path)
    if removed:
        log.warning("removed %d memory-tier folder(s) left by processes that died: %s", len(removed), removed)
    return removed


@contextlib.contextmanager
def _unless_held(folder: str, pid: int) -> Iterator[bool]:
    """Whether ``folder`` is an orphan, holding its lock meanwhile so that no one takes it up."""
    try:
        fd = os.open(os.path.join(folder, LOCK), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        yield not pid_alive(pid)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def current() -> str | None:
    """The folder of the innermost open ``keep_memory`` block, or None."""
    return _scope[-1] if _scope else None


def private_folder(path: str) -> str:
    """``path`` when it is an absolute path to a real folder (no link) that this user owns and no one else may
    enter; MemoryTierUnavailable saying why otherwise."""
    if not os.path.isabs(path):
        raise MemoryTierUnavailable(f"{MEMORY_ENV} is not an absolute path")
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise MemoryTierUnavailable(f"its folder cannot be read ({exc.__class__.__name__})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MemoryTierUnavailable(f"{path} is not a folder")
    if st.st_uid != os.getuid():
        raise MemoryTierUnavailable(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise MemoryTierUnavailable(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o})")
    return path


def room_needed(per_rank: float, local_ranks: int, across_hosts: bool, flash: bool = False) -> float:
    """Bytes of shared memory the tier takes on a host: every local rank's state for the snapshots kept plus one
    being written; with ``flash`` snapshots, two slots of every local rank's state (trainer.checkpoint.flash).
    Twice that across hosts: each host also keeps its peer's (trainer.checkpoint.peer_copy, flash_peers)."""
    copies = per_rank * local_ranks * (SNAPSHOTS_KEPT if flash else SNAPSHOTS_KEPT + 1)
    return copies * (2 if across_hosts else 1)


def room_free(folder: str, per_rank: float, local_ranks: int) -> float:
    """Bytes the tier may take on this host: the free space of the file system holding ``folder``, and no more
    than the available memory once every local rank has staged its copy of its state (``per_rank`` bytes; 0 for
    flash snapshots, which copy straight into their slots)."""
    fs = os.statvfs(folder)
    return min(fs.f_bavail * fs.f_frsize, available_memory() - per_rank * local_ranks)


def available_memory() -> int:
    """This host's available memory in bytes (Linux's MemAvailable; unbounded where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            line = next(x for x in f if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return 1 << 62


def run_key(store_root: str, run_name: str) -> str:
    """The name of a run's subfolder in a memory tier's folder (its store and name)."""
    return hashlib.sha256(f"{store_root}\0{run_name}".encode()).hexdigest()[:24]


def run_checkpoints(folder: str, store_root: str, run_name: str) -> str:
    """Where a run's snapshots lie in the memory tier's ``folder``: one subfolder per run (store and name), so
    two runs in one block never read each other's."""
    return os.path.join(folder, run_key(store_root, run_name), "checkpoints")


Tier = Literal["memory", "store"]
T = TypeVar("T")


def restore_order(store: Iterable[T], memory: Iterable[T], step: Callable[[T], int]) -> list[tuple[T, Tier]]:
    """The order a resume tries checkpoints in, each with its tier: newest first, and at one step the memory
    tier's copy before the store's (it loads faster). The resume loads the first that verifies."""
    tagged: list[tuple[T, Tier]] = [(i, "store") for i in store]
    tagged.extend((i, "memory") for i in memory)
    return sorted(tagged, key=lambda pair: (step(pair[0]), pair[1] == "memory"), reverse=True)
