"""A checkpoint's proof of itself, as its manifest records it (docs/architecture.md §4): the hash of the whole
training state, each rank's RNG hash and the sample ledger. ``state_hash`` computes them; this module is the
record, without torch, so that the orchestrator reads manifests without importing it.

The hashes are checksums against a load that did not restore what was saved (a field forgotten, a wrong shard,
a file corrupted before its sha256 was taken), not signatures: whoever can write the store can rewrite a
manifest (docs/security.md).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

PRIME = (1 << 61) - 1
HEX = r"^[0-9a-f]{32}$"
SHA256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class Sum:
    """Two lanes of exact sums modulo 2^61 - 1; ``+`` adds another rank's or another tensor's."""

    __slots__ = ("a", "b")

    def __init__(self, a: int = 0, b: int = 0):
        self.a, self.b = a % PRIME, b % PRIME

    def __add__(self, other: Sum) -> Sum:
        return Sum(self.a + other.a, self.b + other.b)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sum) and (self.a, self.b) == (other.a, other.b)

    def __hash__(self) -> int:
        return hash((self.a, self.b))

    def hex(self) -> str:
        return f"{self.a:016x}{self.b:016x}"

    @classmethod
    def parse(cls, text: str) -> Sum:
        return cls(int(text[:16], 16), int(text[16:], 16))

    def pair(self) -> tuple[int, int]:
        return self.a, self.b


class RankProof(BaseModel):
    """One rank's part of a checkpoint's proof, gathered by the commit."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    state: tuple[int, int]
    rng: str
    ledger: tuple[int, int] | None
    samples: int


class CheckpointProof(BaseModel):
    """The ``proof`` of a checkpoint's manifest: read from the store, so bounded and typed (docs/security.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    state: str = Field(pattern=HEX, description="The state hash: model, optimizer, scheduler, progress, data.")
    rng: list[SHA256] = Field(max_length=1 << 20, description="Each rank's RNG hash (sha256), by rank.")
    ledger: str | None = Field(default=None, pattern=HEX, description="The digest of the samples consumed through it.")
    samples: int = Field(ge=0, le=1 << 62, description="How many samples the ledger counts.")

    @classmethod
    def combine(cls, parts: list[RankProof]) -> CheckpointProof:
        state = sum((Sum(*p.state) for p in parts), Sum())
        ledgers = [p.ledger for p in parts]
        ledger = None if None in ledgers else sum((Sum(*x) for x in ledgers if x), Sum()).hex()
        return cls(state=state.hex(), rng=[p.rng for p in parts], ledger=ledger, samples=sum(p.samples for p in parts))
