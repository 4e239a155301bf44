"""The memory tier across hosts: each host's snapshot files copied to a peer host, and gathered back on restore.

A snapshot lies in the memory of the host whose ranks wrote it, so a host that is lost takes its ranks' files
with it. After every rank has written its share of a snapshot (and before the snapshot commits), each rank
sends the files it wrote to the rank with its local rank on the next host of the ring (``PeerRing``), which
checks every byte against the hashes the ranks gathered for the commit and writes them beside its own: one
copy per host, on another host (docs/architecture.md §4, "The memory tier"). A restore then finds each file on
some host that lives; ``completion_plan`` says which host sends which missing file to which, so that every
host holds the whole snapshot before the ranks load it as they load any checkpoint (each file verified against
the manifest again as it is read). Files travel over the checkpointer's own gloo group (at a save, on the
upload's thread) or the CPU group (at a restore): never over the training's collectives.

A file from a peer is accepted only under a name the manifest lists (a plain relative path inside the step's
folder) and only with the size and sha256 recorded for it; anything else is refused with one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import tempfile
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from trainpipe.trainer.checkpoint.catalog import CheckpointInfo
from trainpipe.trainer.checkpoint.files import ChecksumMismatch, inside_folder
from trainpipe.trainer.store_paths import step_uri

Written = dict[str, tuple[str, int]]  # a file's name in the step's folder → (sha256, bytes)


@dataclass(frozen=True)
class PeerRing:
    """This rank's place among the job's hosts: torchrun numbers ranks host by host (``GROUP_RANK`` ×
    ``LOCAL_WORLD_SIZE`` + ``LOCAL_RANK``), so host ``h`` holds ranks ``h*L`` to ``h*L + L - 1``."""

    rank: int
    world_size: int
    local_world_size: int

    @classmethod
    def of_job(cls, rank: int, world_size: int) -> PeerRing | None:
        """The ring of this torchrun job (its environment), or None on a single host or uneven hosts."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if local <= 0 or world_size % local or world_size // local < 2:
            return None
        return cls(rank, world_size, local)

    @property
    def hosts(self) -> int:
        return self.world_size // self.local_world_size

    def host_of(self, rank: int) -> int:
        return rank // self.local_world_size

    @property
    def leader(self) -> bool:
        """Whether this rank speaks for its host's folder (its local rank 0)."""
        return self.rank % self.local_world_size == 0

    @property
    def peer(self) -> int:
        """The rank on the next host that keeps a copy of this rank's files."""
        return self.peer_of(self.rank)

    def peer_of(self, rank: int) -> int:
        """The rank on the host after ``rank``'s that keeps a copy of ``rank``'s files."""
        return (rank + self.local_world_size) % self.world_size

    def source_of(self, rank: int) -> int:
        """The rank on the host before ``rank``'s whose files ``rank`` keeps."""
        return (rank - self.local_world_size) % self.world_size

    @property
    def source(self) -> int:
        """The rank on the previous host whose files this rank keeps."""
        return self.source_of(self.rank)


def send_to_peer(step_dir: str, mine: Written, every: Written, ring: PeerRing, group: dist.ProcessGroup) -> str:
    """Send the files this rank wrote (``mine``) to its peer and keep its source's in ``step_dir``, checked
    against ``every`` (all ranks' files as the commit will list them). Every rank must call it (the ring moves
    at once); this rank's problem ("" when none), which the caller shares with every rank."""
    try:
        outgoing = _pack(step_dir, mine)
    except OSError as exc:  # still sent, as a payload the peer refuses: the ring must not hang on one rank
        outgoing, problem = _unreadable(), f"its own files cannot be read for its peer ({exc.__class__.__name__})"
    else:
        problem = ""
    incoming = _exchange(outgoing, ring.peer, ring.source, group)
    try:
        for name, data in accept(incoming, every).items():
            write_inside(step_dir, name, data)
    except (ChecksumMismatch, OSError) as exc:
        problem = problem or str(exc)
    return problem


def resumable(views: list[list[tuple[CheckpointInfo, set[str]]] | None], folder: str) -> list[CheckpointInfo]:
    """The snapshots the hosts can resume between them, oldest first: each host leader's ``view`` (its committed
    snapshots and the files its folder holds of each; None from the other ranks), a snapshot counting when every
    file its manifest lists lies on some host. Each is described by the first host's manifest that has it, at
    its place in this rank's own host's ``folder``."""
    by_step: dict[int, CheckpointInfo] = {}
    held: dict[int, set[str]] = {}
    for view in views:
        for info, files in view or []:
            by_step.setdefault(info.step, info)
            held.setdefault(info.step, set()).update(files)
    return [
        replace(info, uri=step_uri(folder, step))
        for step, info in sorted(by_step.items())
        if set(info.manifest.get("files", {})) <= held[step]
    ]


def completion_plan(held: list[set[str] | None], needed: set[str], ring: PeerRing) -> list[tuple[int, int, str]]:
    """(sending rank, receiving rank, file) so that every host holds every ``needed`` file: each host's leader
    reports what its host holds (``held``, indexed by rank: None from the other ranks), and a file a host lacks
    comes from the leader of the first host that holds it. Pure, so every rank computes the same plan."""
    leaders = [r for r in range(0, ring.world_size, ring.local_world_size)]
    plan = []
    for name in sorted(needed):
        holders = [r for r in leaders if name in (held[r] or set())]
        if not holders:
            continue  # the caller checked that the union covers ``needed``
        plan += [(holders[0], r, name) for r in leaders if name not in (held[r] or set())]
    return plan


def gather_snapshot(
    step_dir: str, manifest: dict, held: list[set[str] | None], ring: PeerRing, group: dist.ProcessGroup | None
) -> tuple[list[tuple[int, int, str]], str]:
    """Make every host's ``step_dir`` hold every file of the snapshot ``manifest`` describes, given what each
    host's leader holds (``held``, by rank), with ``completion_plan``; (the plan, this rank's problem with what it
    received, "" when none). Every rank calls it."""
    sizes = manifest.get("sizes") or {}
    every = {name: (sha, int(sizes.get(name, -1))) for name, sha in manifest["files"].items()}
    plan = completion_plan(held, set(every), ring)
    if any(dst == ring.rank for _, dst, _ in plan):
        os.makedirs(step_dir, mode=0o700, exist_ok=True)
    return plan, complete(step_dir, plan, every, ring.rank, group)


def complete(
    step_dir: str, plan: list[tuple[int, int, str]], every: Written, rank: int, group: dist.ProcessGroup | None
) -> str:
    """Carry out a ``completion_plan`` (every rank walks it alike: each transfer involves its two ranks only);
    this rank's problem with what it received ("" when none)."""
    problem = ""
    for src, dst, name in plan:
        if rank == src:
            try:
                payload = _pack(step_dir, {name: every[name]})
            except OSError as exc:
                payload, problem = _unreadable(), problem or f"{name} cannot be read ({exc.__class__.__name__})"
            dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst, group=group)
            dist.send(payload, dst, group=group)
        elif rank == dst:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, src, group=group)
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(payload, src, group=group)
            try:
                for got, data in accept(payload, {name: every[name]}).items():
                    write_inside(step_dir, got, data)
            except (ChecksumMismatch, OSError) as exc:
                problem = problem or str(exc)
    return problem


def accept(payload: torch.Tensor, expected: Written) -> dict[str, bytes]:
    """The files in ``payload`` (a header line of JSON ``[[name, size], …]``, then the bytes), each only under a
    name ``expected`` lists and with its recorded size and sha256; ChecksumMismatch (one line) otherwise."""
    raw = payload.numpy().tobytes()
    head, sep, body = raw.partition(b"\n")
    try:
        entries = json.loads(head) if sep else None
    except ValueError:
        entries = None
    if not isinstance(entries, list) or not all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and type(e[1]) is int and e[1] >= 0
        for e in entries
    ):
        raise ChecksumMismatch("a peer's snapshot copy has no readable list of its files; refused")
    files, at = {}, 0
    for name, size in entries:
        if name not in expected:
            raise ChecksumMismatch(f"a peer sent {name[:200]!r}, which this snapshot does not list; refused")
        data = body[at : at + size]
        at += size
        sha, recorded = expected[name]
        if len(data) != size or size != recorded or hashlib.sha256(data).hexdigest() != sha:
            raise ChecksumMismatch(f"a peer's copy of {name} fails its size or sha256 (altered or of another run)")
        files[name] = data
    if at != len(body):
        raise ChecksumMismatch("a peer's snapshot copy holds more bytes than its files; refused")
    return files


def write_inside(step_dir: str, name: str, data: bytes) -> None:
    """Write ``data`` as ``name`` inside ``step_dir``, whole (beside it, then renamed over it): a plain relative
    path only, never a link's target or anything outside the folder."""
    parts = name.split("/")
    if not inside_folder(name) or "\\" in name or "\0" in name:
        raise ChecksumMismatch(f"a peer's file name {name[:200]!r} is not a plain path inside the snapshot")
    folder = step_dir
    for part in parts[:-1]:
        folder = os.path.join(folder, part)
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            if os.path.islink(folder) or not os.path.isdir(folder):
                raise ChecksumMismatch(f"{folder} is not a folder; a peer's file is not written there") from None
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".peer-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(folder, parts[-1]))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def held_files(step_dir: str) -> set[str]:
    """The regular files under ``step_dir`` by relative name (links and anything else left out)."""
    found = set()
    for top, dirs, names in os.walk(step_dir):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
        for name in names:
            path = os.path.join(top, name)
            if os.path.isfile(path) and not os.path.islink(path) and not name.startswith(".peer-"):
                found.add(posixpath.relpath(path, step_dir).replace(os.sep, "/"))
    return found


def _pack(step_dir: str, files: Written) -> torch.Tensor:
    entries, chunks = [], []
    for name in sorted(files):
        with open(os.path.join(step_dir, name), "rb") as f:
            data = f.read()
        entries.append([name, len(data)])
        chunks.append(data)
    raw = json.dumps(entries).encode() + b"\n" + b"".join(chunks)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _unreadable() -> torch.Tensor:
    return torch.frombuffer(bytearray(b"null\n"), dtype=torch.uint8)


def _exchange(outgoing: torch.Tensor, to: int, frm: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send ``outgoing`` to rank ``to`` while receiving from rank ``frm`` (non-blocking both ways: a ring)."""
    size_in = torch.zeros(1, dtype=torch.int64)
    works = [
        dist.isend(torch.tensor([outgoing.numel()], dtype=torch.int64), to, group=group),
        dist.irecv(size_in, frm, group=group),
    ]
    for w in works:
        if w is not None:  # None only for a rank outside ``group``
            w.wait()
    incoming = torch.empty(int(size_in.item()), dtype=torch.uint8)
    works = [dist.isend(outgoing, to, group=group), dist.irecv(incoming, frm, group=group)]
    for w in works:
        if w is not None:
            w.wait()
    return incoming
