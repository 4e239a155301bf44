"""A resume from flash snapshots, on every rank alike (trainer.checkpoint.flash, flash_peers; docs/architecture.md §4).

``open_flash`` gives a rank its slots (with the ranks' group, and across hosts its ring) when the job can take
flash snapshots; ``FlashResume`` then finds the steps every rank can load (its own slots, or the copy its peer
keeps), brings a lost host's ranks their snapshots back from their peers, and reads one, each byte checked and
its values a trainer's snapshot of that step, before the trainer loads and proves it.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainpipe.trainer.checkpoint.catalog import CheckpointInfo
from trainpipe.trainer.checkpoint.files import ChecksumMismatch
from trainpipe.trainer.checkpoint.flash import FlashSnapshots, SlotRecord, not_for
from trainpipe.trainer.checkpoint.flash_peers import FlashPeers, fetch, fetch_plan, resumable_steps
from trainpipe.trainer.checkpoint.peer_copy import PeerRing
from trainpipe.trainer.config import Profile
from trainpipe.trainer.device import Distributed, new_group

log = logging.getLogger("trainpipe.trainer")

Snapshot = tuple[dict[str, Any], dict[str, Any], SlotRecord]  # the state, the rank's extra values, the record


def open_flash(
    profile: Profile, d: Distributed, memory_dir: str | None, ring: PeerRing | None, sharded: bool
) -> FlashSnapshots | None:
    """This rank's flash snapshots' slots, when the memory tier is on and asks for them and the job can use them
    (plain tensors: not ``sharded``); else None, said once by rank 0. A collective where it returns slots."""
    if memory_dir is None or profile.checkpoint.memory_snapshot != "flash":
        return None
    if why := not_for(sharded):
        if d.rank == 0:
            log.warning("checkpoint.memory_snapshot=flash needs DDP or one rank, and this job's %s: its "
                        "snapshots are written by dcp", why)  # fmt: skip
        return None
    # The snapshots' background threads end each round together (and, across hosts, copy each slot to a peer
    # host) on a gloo group of their own, never the training's. A rank that waits for a round waits in the
    # checkpoint phase (Trainer.save); the group gives up well within that phase's allowance, so a peer gone
    # leaves the others training alone rather than a hang for the watchdog to blame on them.
    w = profile.watchdog
    timeout = timedelta(seconds=min(w.pg_timeout_s, w.slow_phase_timeout_s / 2))
    group = new_group(backend="gloo", timeout=timeout) if d.world_size > 1 else None
    peers = FlashPeers(ring, group) if group is not None else None
    return FlashSnapshots(os.path.join(os.path.dirname(memory_dir), "flash"), d.rank, peers)


class FlashResume:
    """The ranks' resume from ``flash`` (every method a collective over ``group``, the ranks' CPU group)."""

    def __init__(self, flash: FlashSnapshots, ring: PeerRing | None, d: Distributed, group: Any) -> None:
        self.flash, self.ring, self.d, self.group = flash, ring, d, group
        self.views: list[tuple[set[int], set[int]]] = []  # per rank: steps in its slots, in the copies it keeps

    def held(self) -> list[CheckpointInfo]:
        """The flash snapshots every rank can load: a whole record in its own slots or, across hosts, in the copy
        its peer keeps; each described by the manifest of the lowest rank that holds a record of it (a DDP
        replica's, the same on every rank)."""
        flash = self.flash
        own = {r.step: r.manifest for r in flash.records().values()}
        copies = {r.step: r.manifest for r in flash.copies.records().values()} if flash.copies else {}
        every: list[Any] = [None] * self.d.world_size
        dist.all_gather_object(every, (set(own), set(copies), {**copies, **own}), group=self.group)
        self.views = [(mine, kept) for mine, kept, _ in every]
        manifest = lambda step: next(m[step] for *_, m in every if step in m)  # noqa: E731
        uri = lambda step: os.path.join(flash.root, f"step-{step:08d}")  # noqa: E731
        steps = resumable_steps(self.views, self.ring)
        return [CheckpointInfo(uri(s), s, True, True, manifest=manifest(s)) for s in steps]

    def fetch(self, info: CheckpointInfo) -> bool:
        """Every rank lacking ``info``'s snapshot in its own slots gets its peer's copy back into them; whether
        any did. ChecksumMismatch on every rank when one did not arrive whole."""
        if self.ring is None or self.flash.peers is None:
            return False
        plan = fetch_plan(self.views, info.step, self.ring)
        problem = fetch(plan, info.step, self.flash, self.flash.copies, self.flash.peers)
        problems: list[str] = [""] * self.d.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        if any(problems):
            raise ChecksumMismatch(f"{info.uri}: {next(p for p in problems if p)}")
        if self.d.rank == 0 and plan:
            log.info("fetched the flash snapshot of step %d for rank(s) %s from their peers' copies", info.step,
                     ", ".join(str(dst) for _, dst in plan))  # fmt: skip
        return bool(plan)

    def read(self, info: CheckpointInfo) -> Snapshot:
        """Every rank's snapshot of ``info``'s step, each byte checked against its checksum and its values a trainer's
        snapshot of that step; ChecksumMismatch on every rank when one rank's is not."""
        got, problem = None, ""
        try:
            got = self.flash.read(info.step)
            problem = not_a_trainers_snapshot(*got, info.step)
        except ChecksumMismatch as exc:
            problem = str(exc)
        problems: list[str] = [""] * self.d.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        if any(problems):
            raise ChecksumMismatch(f"{info.uri}: {next(p for p in problems if p)}")
        assert got is not None
        return got

    def folders(self) -> set[int]:
        """The ranks whose flash folders this host keeps: its own ranks', and across hosts the copies they keep."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.d.world_size))
        host = self.d.rank // max(local, 1)
        mine = set(range(host * local, min((host + 1) * local, self.d.world_size)))
        return mine | ({self.ring.source_of(r) for r in mine} if self.ring is not None else set())


def not_a_trainers_snapshot(state: Any, extra: Any, record: SlotRecord, step: int) -> str:
    """Why a flash snapshot's values are not what ``Trainer.save`` puts in one of ``step`` ('' when they are):
    its state's sections, its progress at the step its record and the resume name, the RNG streams."""
    sections = ("model", "optim", "scheduler", "progress")
    if not isinstance(state, dict) or not all(isinstance(state.get(k), dict) for k in sections):
        return f"step {step}'s snapshot does not hold a model, optimizer, scheduler and progress"
    progress = state["progress"]
    if not (progress.get("step") == record.step == step and type(progress.get("tokens")) is int):
        return f"step {step}'s snapshot records progress {progress!r:.80} at step {record.step}"
    if not isinstance(extra.get("rng"), dict):
        return f"step {step}'s snapshot holds no RNG streams"
    return ""
