"""The links between hosts, measured before an attempt's first step (docs/architecture.md §9).

After a ``network`` incident (collectives slow on every rank, compute flat)
the watchdog cannot tell which host's link is slow: in a ring every rank waits
for the slowest hop. The retry sets ``watchdog.probe_links``; then each host's
k-th rank ping-pongs a buffer with the next host's k-th rank (a "rail": on hosts
with a NIC per GPU, local rank k's NIC), for each link of the host ring, in two
or three rounds in which no host is in two pairs (its rails ping at once).
Every rank gets the same times and decides alike, with no collective after;
each rail is judged on its own, against the fastest link of any rail:

- a host whose both ring links are slow (above ``network_factor`` times the
  fastest link, never under ``MIN_FACTOR`` times, and by at least
  ``MIN_EXCESS_S``) is the culprit: ``SlowLinks`` names it, and the policy
  retries without it when the cluster can shrink;
- a slow link between two otherwise fast hosts is named as the link.

Two hosts have one link and nothing to compare it with: the times are logged,
nobody is blamed. Nor is anyone when every link is slow (the fabric).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainpipe.trainer.device import Distributed
from trainpipe.trainer.errors import TrainpipeError
from trainpipe.trainer.proc import node_name

log = logging.getLogger("trainpipe.trainer")

MIN_EXCESS_S = 0.0005  # a link this little slower than the fastest is noise, whatever the ratio
MIN_FACTOR = 3.0  # whatever watchdog.network_factor says: a verdict excludes a node, jitter must not
PROBE_MB = 1.0  # a few TCP windows: a delay and a thin link both show, in milliseconds on a healthy one
REPEATS = 3  # the fastest of these ping-pongs: a busy core slows one, a slow link every one


@dataclass(frozen=True)
class LinkTimes:
    """One rail's ring: ``seconds[i]`` is the round trip of ``hosts[i]`` <-> ``hosts[(i + 1) % len(hosts)]``."""

    hosts: list[str]  # the host ring, in rank order
    leaders: list[int]  # each host's rank on this rail, which measured for it
    seconds: list[float]
    rail: int | None = None  # the local rank, when a host has several

    def link(self, i: int) -> str:
        on = f" (local rank {self.rail})" if self.rail is not None else ""
        return f"{self.hosts[i]}<->{self.hosts[(i + 1) % len(self.hosts)]}{on}"

    def text(self) -> str:
        return ", ".join(f"{self.link(i)} {s * 1000:.1f} ms" for i, s in enumerate(self.seconds))


@dataclass(frozen=True)
class Verdict:
    hosts: list[str]  # hosts whose every link is slow
    links: list[str]  # slow links between hosts that are otherwise fast


class SlowLinks(TrainpipeError):
    """The link probe found a slow host or link: a ``network`` incident from the attempt's start."""

    def __init__(self, rails: list[LinkTimes], verdict: Verdict, factor: float):
        self.times, self.verdict = rails[0], verdict  # rail 0: each host's lowest rank, the one to name
        blamed = [f"{h}'s links" for h in verdict.hosts] + [f"the link {link}" for link in verdict.links]
        fastest = min(min(t.seconds) for t in rails) * 1000
        measured = "; ".join(t.text() for t in rails)
        check = (
            "check that host's network (cable, NIC, switch port) or run without it"
            if verdict.hosts
            else "check the cables and switch ports between those hosts"
        )
        super().__init__(
            f"the link probe before the first step found {' and '.join(blamed)} slow (over "
            f"{max(factor, MIN_FACTOR):g}x the fastest link, {fastest:.1f} ms): {measured} for a {PROBE_MB:g} MB "
            f"ping-pong; {check}"
        )


def ring_links(hosts: int) -> list[list[int]]:
    """The ring's links (link i joins host i and i+1) in rounds in which no host is in two links."""
    if hosts < 2:
        return []
    if hosts == 2:
        return [[0]]
    even = [i for i in range(0, hosts - 1, 2)]
    odd = [i for i in range(1, hosts - 1, 2)]
    closing = [hosts - 1]  # the link back to host 0; with an even count it fits the odd round
    if hosts % 2 == 0:
        return [even, odd + closing]
    return [even, odd, closing]


def judge(times: LinkTimes, factor: float, fastest: float | None = None) -> Verdict:
    """Which hosts or links of one rail are slow, against the fastest link (of any rail, when given)."""
    n = len(times.seconds)
    if len(times.hosts) < 3 or n < 3:
        return Verdict([], [])
    fastest, factor = min(times.seconds) if fastest is None else fastest, max(factor, MIN_FACTOR)
    slow = {i for i, s in enumerate(times.seconds) if s > factor * fastest and s - fastest > MIN_EXCESS_S}
    if not slow or len(slow) == n:
        return Verdict([], [])
    h = len(times.hosts)
    hosts = [times.hosts[j] for j in range(h) if (j - 1) % h in slow and j in slow]
    links = [
        times.link(i) for i in sorted(slow) if times.hosts[i] not in hosts and times.hosts[(i + 1) % h] not in hosts
    ]
    return Verdict(hosts, links)


def measure_links(d: Distributed) -> list[LinkTimes]:
    """Every rank calls this; one ``LinkTimes`` per rail, none with a single host. Host names come from
    ``node_name`` on each rank; a host's k-th rank (by global rank) is on its rail k."""
    names: list[str | None] = [None] * d.world_size
    dist.all_gather_object(names, node_name())
    ranks: dict[str, list[int]] = {}
    for r, name in enumerate(names):
        ranks.setdefault(str(name), []).append(r)
    hosts = list(ranks)
    if len(hosts) < 2:
        return []
    rails = min(len(v) for v in ranks.values())
    device = torch.device("cpu") if dist.get_backend() == "gloo" else d.device  # gloo sends host memory only
    buf = torch.ones(max(1, int(PROBE_MB * (1 << 20) / 4)), dtype=torch.float32, device=device)
    seconds = torch.zeros(rails, len(hosts), dtype=torch.float64, device=device)
    for round_ in ring_links(len(hosts)):
        dist.barrier()
        for i in round_:
            for k in range(rails):
                a, b = ranks[hosts[i]][k], ranks[hosts[(i + 1) % len(hosts)]][k]
                if d.rank == a:
                    seconds[k, i] = min(_ping(buf, b, first=True) for _ in range(REPEATS))
                elif d.rank == b:
                    for _ in range(REPEATS):
                        _ping(buf, a, first=False)
    dist.all_reduce(seconds)  # each link's time was written by one rank only
    n_links = 1 if len(hosts) == 2 else len(hosts)
    return [
        LinkTimes(hosts, [ranks[h][k] for h in hosts], seconds[k, :n_links].tolist(), k if rails > 1 else None)
        for k in range(rails)
    ]


def _ends(link: str) -> list[str]:
    """The two hosts of a link as ``LinkTimes.link`` writes it."""
    return link.split(" (local rank ", 1)[0].split("<->", 1)


def _ping(buf: torch.Tensor, peer: int, first: bool) -> float:
    t0 = time.perf_counter()
    if first:
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)
    return time.perf_counter() - t0


def probe_links(d: Distributed, factor: float) -> list[LinkTimes]:
    """Measure, log on rank 0, and raise ``SlowLinks`` when a host or link of any rail is to blame."""
    rails = measure_links(d)
    if not rails:
        return rails
    if d.rank == 0:
        log.info("link probe: %s", "; ".join(t.text() for t in rails))
    verdict = verdict_of(rails, factor)
    if verdict.hosts or verdict.links:
        raise SlowLinks(rails, verdict, factor)
    return rails


def verdict_of(rails: list[LinkTimes], factor: float) -> Verdict:
    """Every rail judged against the fastest link of any: the hosts any rail blames, and the slow links that
    touch none of them."""
    fastest = min(min(t.seconds) for t in rails)
    verdicts = [judge(t, factor, fastest) for t in rails]
    hosts = [h for h in rails[0].hosts if any(h in v.hosts for v in verdicts)]
    links = [link for v in verdicts for link in v.links if not set(_ends(link)) & set(hosts)]
    return Verdict(hosts, links)
