"""This rank's part of each checkpoint's proof, and the check of the one an attempt resumes from
(trainer/checkpoint/proof.py, state_hash.py; docs/architecture.md §4).

At a save: the rank's part of the state hash (model, optimizer, scheduler, progress, data position), the hash of
its RNG streams and its part of the sample ledger. At a resume: the loaded state hashed again, which must be the
recorded hash, and the rank's restored RNG streams (at the same world size); a mismatch is a ``ProofMismatch``,
a ``ChecksumMismatch`` like a corrupt file's, so the loop tries the older checkpoint.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch.distributed as dist

from trainpipe.trainer.checkpoint.catalog import CheckpointInfo, read_proof
from trainpipe.trainer.checkpoint.files import ChecksumMismatch
from trainpipe.trainer.checkpoint.flash import FlashProof
from trainpipe.trainer.checkpoint.proof import RankProof, Sum
from trainpipe.trainer.checkpoint.state_hash import ledger_sum, rng_digest, state_sum

log = logging.getLogger("trainpipe.trainer")


class ProofMismatch(ChecksumMismatch):
    """The state a checkpoint loaded into is not the one its proof records."""


class Proving:
    """The ledger of the samples this rank read since the resumed checkpoint (rank 0 carries that checkpoint's),
    and whether the resume verified its state."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        cuda_index: int | None,
        group: dist.ProcessGroup | None,
        holders: tuple[int, int] | None = None,
        replicas: dict[str, int] | None = None,
    ):
        self.rank, self.world_size, self.cuda_index, self.group = rank, world_size, cuda_index, group
        self.holders = holders  # this rank's index among those holding its plain tensors, and their number
        self.replicas = replicas  # its coordinates on the dimensions a DTensor of a smaller mesh is copied over
        self.copies: frozenset[str] = frozenset()  # parameters whose state another pipeline stage hashes
        self.per_parameter = False  # the optimizer state hashed is flattened per parameter (state_sum)
        self.ledger: Sum | None = Sum()  # None: a checkpoint before it recorded no ledger, so the count is unknown
        self.samples = 0
        self.verified: bool | None = None  # None: the attempt did not resume

    def account(self, first_position: int, ids: np.ndarray, n_samples: int) -> None:
        """This rank read ``ids`` at the sample order's positions from ``first_position`` on."""
        if self.ledger is not None:
            self.ledger = self.ledger + ledger_sum(np.arange(first_position, first_position + len(ids)), ids, n_samples)
            self.samples += len(ids)

    def part(self, position: dict[str, Any], rng: dict[str, Any]) -> Callable[[dict[str, Any]], RankProof]:
        """This rank's part of the proof of the checkpoint being saved now, as a function of its state (the live
        one, or the copy the async save staged, hashed off the loop's thread): the ledger and the RNG hash are
        taken now, the state hash (with the data position ``position``) when it is called."""
        ledger, samples, rng_hash = self.ledger, self.samples, rng_digest(rng, self.cuda_index)
        per_parameter = self.per_parameter

        def of(state: dict[str, Any]) -> RankProof:
            return RankProof(
                state=self._sum({**state, "data_position": position}, per_parameter).pair(),
                rng=rng_hash,
                ledger=ledger.pair() if ledger is not None else None,
                samples=samples,
            )

        return of

    def check(
        self,
        info: CheckpointInfo,
        state: dict[str, Any],
        rng: dict[str, Any] | None,
        samples: int,
        per_parameter: bool = False,
    ) -> None:
        """The state just loaded from ``info`` (with the data position in it) against its proof, on every rank
        alike; ``rng``: this rank's streams when they were restored (same world size), else None. ``samples``:
        what the steps up to it consumed, which the ledger's count must be."""
        proof = read_proof(info.manifest)
        if proof is None:  # written before checkpoints proved themselves
            self.verified, self.ledger, self.samples = False, None, 0
            return
        mine = self._sum(state, per_parameter)
        rng_ok = rng is None or rng_digest(rng, self.cuda_index) == proof.rng[self.rank]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, (mine.pair(), rng_ok), group=self.group)
        loaded = sum((Sum(*pair) for pair, _ in every), Sum())
        if loaded.hex() != proof.state:
            raise ProofMismatch(
                f"{info.uri}: the state loaded from it hashes to {loaded.hex()}, not to the {proof.state} recorded "
                "at its save (a file that does not hold what was saved, or a load that did not restore it)"
            )
        if bad := [r for r, (_, ok) in enumerate(every) if not ok]:
            raise ProofMismatch(f"{info.uri}: rank {bad[0]}'s RNG streams are not the ones recorded at its save")
        self.verified = True
        # The ledger goes on only from a count that is the steps' own (the state hash does not cover it).
        ledger = proof.ledger if proof.samples == samples else None
        whole = ledger is not None
        self.ledger = (Sum.parse(ledger) if self.rank == 0 else Sum()) if ledger is not None else None
        self.samples = proof.samples if whole and self.rank == 0 else 0

    def flash_part(self, rng: dict[str, Any]) -> FlashProof:
        """This rank's part of a flash snapshot's proof (trainer.checkpoint.flash): the RNG hash and the ledger;
        the state is proved by its bytes' checksums."""
        ledger = self.ledger.pair() if self.ledger is not None else None
        return FlashProof(rng=rng_digest(rng, self.cuda_index), ledger=ledger, samples=self.samples)

    def check_flash(
        self,
        info: CheckpointInfo,
        bytes_ok: bool,
        sums: list[int],
        rng: dict[str, Any] | None,
        samples: int,
        proof: FlashProof,
    ) -> None:
        """A flash snapshot just loaded, on every rank alike: ``bytes_ok``, whether this rank's state now holds
        the bytes its snapshot recorded (``sums``: their checksums, which every rank's must be, since a flash
        snapshot's state is a DDP replica's or one rank's); ``rng`` and ``samples`` as for ``check``. The ledger
        goes on from the sum of the ranks' parts, as a checkpoint's combined proof."""
        rng_ok = rng is None or rng_digest(rng, self.cuda_index) == proof.rng
        held = hashlib.sha256(repr(sums).encode()).hexdigest()
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, (bytes_ok, rng_ok, proof.ledger, proof.samples, held), group=self.group)
        if bad := [r for r, (ok, *_) in enumerate(every) if not ok]:
            raise ProofMismatch(
                f"{info.uri}: rank {bad[0]}'s state after the load does not hold the bytes its snapshot recorded"
            )
        if bad := [r for r, (*_, h) in enumerate(every) if h != every[0][4]]:
            raise ProofMismatch(f"{info.uri}: rank {bad[0]}'s replica differs from rank 0's after the load")
        if bad := [r for r, (_, ok, *_) in enumerate(every) if not ok]:
            raise ProofMismatch(f"{info.uri}: rank {bad[0]}'s RNG streams are not the ones recorded at its save")
        self.verified = True
        ledgers = [ledger for _, _, ledger, _, _ in every]
        count = sum(n for _, _, _, n, _ in every)
        whole = None not in ledgers and count == samples
        total = sum((Sum(*x) for x in ledgers if x), Sum())
        self.ledger = (total if self.rank == 0 else Sum()) if whole else None
        self.samples = count if whole and self.rank == 0 else 0

    def _sum(self, state: dict[str, Any], per_parameter: bool) -> Sum:
        return state_sum(state, self.rank, self.world_size, self.holders, self.copies, self.replicas, per_parameter)

    def unverified(self) -> None:
        """``checkpoint.verify_state: false`` let a mismatching checkpoint load: not verified, ledger unknown."""
        self.verified, self.ledger, self.samples = False, None, 0
