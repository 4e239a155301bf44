"""Projected goodput at 1k, 16k and 100k GPUs: a discrete-event simulation that drives trainpipe's decision code.

Nothing here trains. A run of ``--days`` of wall time (default 54, the Llama 3 405B window) is simulated step by
step, with the faults Llama 3 recorded: 419 unexpected interruptions in 54 days on 16,384 H100s (Dubey et al.
2024, "The Llama 3 Herd of Models", Table 5), drawn as a Poisson process at the same rate per GPU and with the
same split between causes. What the run does about each fault is decided by trainpipe's own code, not by a model
of it:

- when to save: ``trainer.loop.checkpoint_schedule.CheckpointSchedule`` (``every_steps: auto`` and
  ``memory_every_steps: auto``: Young/Daly from the measured blocking time, never shorter than a save takes to
  commit), fed the simulated blocking and commit times, with the MTBF the profile says until the run's own
  failures stand for it (``policy.observed_mtbf``, as ``policy.for_attempt`` does);
- how long a hang goes unnoticed: ``trainer.supervise.checks.hang.phase_allowance_s`` at the median step;
- retry, and whether to leave a host out: ``trainer.orchestrate.policy.after_attempt`` over the run's incidents
  (a host that fails twice, a straggler under ``on_straggler: exclude``), and the wait before a retry,
  ``policy.retry_delay_s``;
- where a retry resumes from: ``trainer.checkpoint.memory_tier.restore_order`` over the committed checkpoints
  and snapshots that survived the fault; a save while the previous one still uploads is skipped, as
  ``Checkpointer.save`` skips it.

The profile is the local profile at the scale (8 GPUs a host, the Slurm launcher, ``on_straggler: exclude``,
checkpoint intervals ``auto``). Three variants get the same faults:
- ``store``: checkpoints to the object store only;
- ``memory``: plus snapshots in the host's own memory (the memory tier without its peer copy); a fault that
  takes its host (a GPU, a PSU, maintenance, ...) loses that host's snapshots, so its retry resumes from the
  store;
- ``memory+peer``: the memory tier as built (``trainer.checkpoint.peer_copy``): each snapshot's files also
  copied to a peer host before it commits (its commit takes that copy longer), so a lost host's state comes
  back from its peer.

How trainpipe sees each cause (an assumption per row of ``CAUSES``): a hardware fault crashes the rank on that
host (a CUDA or NCCL error; the host is replaced and its memory lost), a switch, cable or NCCL timeout hangs the
whole collective (the watchdog's allowance; nobody is idle, so the early rule does not apply), a software bug
crashes the rank and keeps the host, a dependency is a store error (retried after a backoff), thermal trouble
slows one host 1.5x until the straggler rule names it, and silent data corruption is found by the replica
check at the next save or every ``watchdog.sdc_every`` steps. A fault of the GPU itself (faulty, HBM3, SRAM,
system processor: 256 of the 419) then fails the GPU health check the supervisor reads after a fault
(``Incident.host_health``), and the policy leaves its host out at once; any other hardware fault fails again in
the retry that runs on its host until the policy leaves the host out at its second failure. A host left out is
replaced by a spare after ``--replace-s``.

Costs per GPU (``Assumptions``; each a flag): a state of 405e9 parameters x 14 bytes (bf16 weights, fp32
master weights and two Adam moments) shared evenly by 16,384 GPUs (346 MB a GPU; the model grows with the
cluster, so the bytes a GPU holds stay the same); a save blocks the loop for its device-to-host copy at 25 GB/s;
the store takes 2 TB/s for 16,384 GPUs (Llama 3's sustained checkpoint bandwidth), the same share a GPU at
every scale; a snapshot commits and restores at this machine's measured rates (``benchmarks/checkpoint_tiers.py``
on 2026-12-05: 385 MB/s into host memory including its hashes, 545 MB/s back, and fixed costs of 0.054 s and
0.044 s; the store's fixed costs 0.267 s and 0.077 s); a restart takes 30 s to its first step before the
restore (rendezvous and communicator setup at 10k+ GPUs, as MegaScale, NSDI '24, reports after its
optimisations); a crash is noticed in 0.5 s (``benchmarks/detection.py`` here); a step takes 6 s.

Printed per scale and variant: goodput (steps kept x step time over the wall) and its ratio to the store
variant's fault-free run (the baseline, simulated in the same invocation), the badput buckets as shares of the
wall (named as ``trainer/orchestrate/badput.py`` names them), the recoveries per tier, and each figure's spread
over ``--seeds`` (the same faults for every variant of a seed). A fourth row, ``store, 2nd``, is the store variant
without the GPU health read after a fault (a broken host left out only at its second failure): the baseline of
that read.

    .venv/bin/python benchmarks/goodput_at_scale.py [--seeds 3] [--days 54] [--scales 1024,16384,102400]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Literal

from trainpipe.trainer.checkpoint.memory_tier import SNAPSHOTS_KEPT, restore_order
from trainpipe.trainer.config import Profile
from trainpipe.trainer.incidents import AttemptRecord, Incident, Kind
from trainpipe.trainer.loop.checkpoint_schedule import CheckpointSchedule
from trainpipe.trainer.orchestrate.policy import after_attempt, observed_mtbf, retry_delay_s
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.supervise.checks.hang import phase_allowance_s

GPUS_PER_HOST = 8
Variant = Literal["store", "memory", "memory+peer"]
VARIANTS: tuple[Variant, ...] = ("store", "memory", "memory+peer")


@dataclass(frozen=True)
class Cause:
    name: str
    count: int  # interruptions in Llama 3's 54 days on 16,384 GPUs
    kind: Kind  # how trainpipe's watchdog and ranks see it
    host_lost: bool  # the host is broken: it fails again until left out, and its memory goes with it
    nvml_sees: bool = False  # its GPU then fails the health check the supervisor reads after a fault


CAUSES = (  # Llama 3, Table 5: root causes of the 419 unexpected interruptions
    Cause("faulty GPU", 148, "crash", True, nvml_sees=True),  # fallen off the bus, a recovery action
    Cause("GPU HBM3 memory", 72, "crash", True, nvml_sees=True),  # uncorrected ECC errors
    Cause("software bug", 54, "crash", False),
    Cause("network switch or cable", 35, "hang", False),
    Cause("host maintenance", 32, "crash", True),
    Cause("GPU SRAM memory", 19, "crash", True, nvml_sees=True),
    Cause("GPU system processor", 17, "crash", True, nvml_sees=True),
    Cause("NIC", 7, "crash", True),
    Cause("NCCL watchdog timeouts", 7, "hang", False),
    Cause("silent data corruption", 6, "sdc", True),
    Cause("GPU thermal interface and sensor", 6, "straggler", True),
    Cause("SSD", 3, "crash", True),
    Cause("power supply", 3, "crash", True),
    Cause("server chassis", 2, "crash", True),
    Cause("IO expansion board", 2, "crash", True),
    Cause("dependency", 2, "error", False),
    Cause("CPU", 2, "crash", True),
    Cause("system memory", 2, "crash", True),
)
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
FAILURES_PER_GPU_S = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 86_400 * LLAMA3_GPUS)
assert sum(c.count for c in CAUSES) == LLAMA3_INTERRUPTIONS


@dataclass(frozen=True)
class Assumptions:
    step_s: float = 6.0
    state_bytes: float = 405e9 * 14 / LLAMA3_GPUS  # per GPU
    d2h_bps: float = 25e9  # the copy a save blocks the loop for
    store_bps: float = 2e12 / LLAMA3_GPUS  # per GPU, writing and reading
    store_fixed_s: tuple[float, float] = (0.267, 0.077)  # commit, restore: measured here at 5 MB
    memory_bps: tuple[float, float] = (385e6, 545e6)  # commit (with hashes), restore: measured here
    memory_fixed_s: tuple[float, float] = (0.054, 0.044)
    peer_bps: float = 3e9  # per GPU: a host's 200 Gb/s front-end NIC shared by 8 GPUs
    startup_s: float = 30.0  # launch to first step, before the restore
    replace_s: float = 60.0  # a spare host in place of one left out
    crash_detect_s: float = 0.5
    slow_factor: float = 1.5  # a thermally throttled host's step

    def blocking_s(self) -> float:
        return self.state_bytes / self.d2h_bps

    def commit_s(self, tier: str, peer: bool = False) -> float:
        if tier == "store":
            return self.store_fixed_s[0] + self.state_bytes / self.store_bps
        copy = self.state_bytes / self.peer_bps if peer else 0.0  # sent to the peer before the commit
        return self.memory_fixed_s[0] + self.state_bytes / self.memory_bps[0] + copy

    def restore_s(self, tier: str, from_peer: bool = False) -> float:
        if tier == "store":
            return self.store_fixed_s[1] + self.state_bytes / self.store_bps
        peer = self.state_bytes / self.peer_bps if from_peer else 0.0
        return self.memory_fixed_s[1] + self.state_bytes / self.memory_bps[1] + peer


@dataclass(frozen=True)
class Fault:
    at: float
    cause: Cause
    host: int  # index into the run's hosts at the time


@dataclass
class Ledger:
    """Seconds of the wall per bucket (trainer/orchestrate/badput.py's names), and counts."""

    productive: float = 0.0
    checkpoint: float = 0.0
    wasted_progress: float = 0.0
    detection: float = 0.0
    startup: float = 0.0
    restore: float = 0.0
    queue: float = 0.0  # a spare host's arrival
    orchestration: float = 0.0  # retry delays
    failures: int = 0
    replaced: int = 0
    recoveries: Counter[str] = field(default_factory=Counter)
    store_every: list[int] = field(default_factory=list)
    memory_every: list[int] = field(default_factory=list)

    BUCKETS = ("checkpoint", "wasted_progress", "detection", "startup", "restore", "queue", "orchestration")

    def wall(self) -> float:
        return self.productive + sum(getattr(self, b) for b in self.BUCKETS)


def scale_profile(gpus: int, variant: Variant) -> Profile:
    """The local profile at ``gpus`` (8 a host), as a large job would set it; a global batch that still divides
    a world of one host fewer, so that the policy may leave a host out."""
    hosts = gpus // GPUS_PER_HOST
    return load_profile(
        "local",
        [
            f"cluster.nodes={hosts}",
            f"cluster.procs_per_node={GPUS_PER_HOST}",
            f"cluster.min_nodes={hosts - 1}",
            f"train.global_batch={GPUS_PER_HOST * hosts * (hosts - 1)}",
            "train.micro_batch=1",
            "train.max_retries=1000000",
            "launcher.kind=slurm",
            "watchdog.on_straggler=exclude",
            "checkpoint.every_steps=auto",
            *([] if variant == "store" else ["checkpoint.memory_every_steps=auto"]),  # off by default
        ],
    )


def draw_faults(gpus: int, days: float, seed: int) -> list[Fault]:
    rng = random.Random(seed)
    rate, end, at, out = FAILURES_PER_GPU_S * gpus, days * 86_400, 0.0, []
    weights = [c.count for c in CAUSES]
    while (at := at + rng.expovariate(rate)) < end:
        out.append(Fault(at, rng.choices(CAUSES, weights)[0], rng.randrange(gpus // GPUS_PER_HOST)))
    return out


@dataclass(frozen=True)
class Saved:
    step: int
    committed_at: float
    tier: str


class Tier:
    """One checkpoint tier during an attempt: its schedule, the save in flight, what it committed."""

    def __init__(
        self, name: str, every: str, mtbf_s: float, start: int, kept: int, a: Assumptions, peer: bool = False
    ) -> None:
        self.name, self.kept, self.a, self.peer = name, kept, a, peer
        self.schedule = CheckpointSchedule(every, mtbf_s, start, agree=lambda figures: figures)
        self.stalls: list[float] = []
        self.durations: list[float] = []  # each committed save's start to commit, as Checkpointer.saves_s
        self.in_flight: Saved | None = None
        self._started = 0.0

    def after_step(self, step: int, now: float, committed: list[Saved], step_times: list[float]) -> float:
        """Save after ``step`` when the schedule says so; the seconds the loop blocked."""
        self.land(now, committed)
        blocked = 0.0
        if self.schedule.due(step):
            if self.in_flight is None:  # else skipped behind the running upload, as Checkpointer.save skips it
                blocked = self.a.blocking_s()
                self.in_flight = Saved(step, now + blocked + self.a.commit_s(self.name, self.peer), self.name)
                self._started = now
            self.stalls.append(blocked)
        self.schedule.observe(step, step_times, self.stalls, durations_s=self.durations)
        return blocked

    def land(self, now: float, committed: list[Saved]) -> None:
        if self.in_flight is not None and self.in_flight.committed_at <= now:
            self.durations.append(self.in_flight.committed_at - self._started)
            committed.append(self.in_flight)
            del committed[: -self.kept]
            self.in_flight = None


def simulate(
    gpus: int, variant: Variant, faults: list[Fault], a: Assumptions, days: float, gpu_health: bool = True
) -> Ledger:
    """One run of ``days`` with ``faults``; ``gpu_health``: the supervisor reads a host's GPUs after a fault."""
    profile = scale_profile(gpus, variant)
    c, w = profile.checkpoint, profile.watchdog
    led, end = Ledger(), days * 86_400
    hosts = list(range(gpus // GPUS_PER_HOST))  # a host's name: its index when it joined
    spare = len(hosts)
    broken: dict[str, Cause] = {}  # hosts with a hardware fault the job still runs on
    store: list[Saved] = []
    memory: list[Saved] = []
    incidents: list[Incident] = []
    records: list[AttemptRecord] = []
    pending = iter(faults)
    nxt = next(pending, None)
    step_times = [a.step_s]
    t, step, attempt, decision_wait, host_lost = 0.0, 0, 0, (0.0, 0.0), False

    def take_fault() -> Fault | None:
        nonlocal nxt
        f, nxt = nxt, next(pending, None)
        return f

    while t < end:
        attempt += 1
        wait, queue = decision_wait
        led.orchestration += wait
        led.queue += queue
        t += wait + queue
        launched = t
        # where the attempt resumes: the newest committed state that survived
        candidates = restore_order(store, memory if variant != "store" else [], lambda s: s.step)
        resume = candidates[0][0] if candidates else None
        restore = a.restore_s(resume.tier, from_peer=variant == "memory+peer" and host_lost) if resume else 0.0
        first_step_at = t + a.startup_s + restore
        fault: Fault | None = None
        if nxt is not None and nxt.at < first_step_at:  # a fault while starting: the attempt fails there
            fault = take_fault()
            assert fault is not None
            led.startup += max(0.0, min(fault.at, t + a.startup_s) - t)
            led.restore += max(0.0, fault.at - (t + a.startup_s))
            t = fault.at
            cause, host_name = fault.cause, str(hosts[fault.host])
        elif broken:  # a broken host the job still runs on fails again at the first step
            led.startup += a.startup_s
            led.restore += restore
            t = first_step_at
            host_name, cause = next(iter(broken.items()))
        else:
            led.startup += a.startup_s
            led.restore += restore
            if resume:
                led.recoveries[resume.tier] += 1
            t = first_step_at
            step = resume.step if resume else 0
            mtbf_h = c.mtbf_hours
            if (seen := observed_mtbf(records)) is not None:  # what policy.for_attempt gives the attempt
                mtbf_h = seen[0]
            tiers = [Tier("store", str(c.every_steps), mtbf_h * 3600, step, c.keep_last, a)]
            if variant != "store":
                every, kept = str(c.memory_every_steps), SNAPSHOTS_KEPT
                tiers.append(Tier("memory", every, mtbf_h * 3600, step, kept, a, peer=variant == "memory+peer"))
            lists = {"store": store, "memory": memory}
            while t < end:
                if nxt is not None and nxt.at < t + a.step_s:  # the step in progress is lost
                    fault = take_fault()
                    assert fault is not None
                    led.wasted_progress += fault.at - t
                    t = fault.at
                    for tier in tiers:  # a save that committed before the fault counts
                        tier.land(t, lists[tier.name])
                    break
                t += a.step_s
                step += 1
                led.productive += a.step_s  # until a retry resumes before it: then moved to wasted_progress
                for tier in tiers:
                    blocked = tier.after_step(step, t, lists[tier.name], step_times)
                    led.checkpoint += blocked
                    t += blocked
            led.store_every.append(tiers[0].schedule.every_steps or 0)
            if variant != "store":
                led.memory_every.append(tiers[1].schedule.every_steps or 0)
            if fault is None:
                break  # the wall ran out
            cause, host_name = fault.cause, str(hosts[fault.host])
        led.failures += 1
        # how long until the watchdog or the agent says so, and what the ranks did meanwhile
        if cause.kind == "hang":
            detect = phase_allowance_s(w, "collective", statistics.median(step_times))
        elif cause.kind == "straggler":  # the slow host's windows: steps go on, each slow_factor as long
            slow_steps = w.straggler_window * w.straggler_patience
            detect = slow_steps * a.step_s * (a.slow_factor - 1)
            led.productive += slow_steps * a.step_s
            step += slow_steps
        elif cause.kind == "sdc":  # found by the replica check before the next save or at the next sdc_every
            corrupted_at = step
            every = w.sdc_every or 1
            due = min([every - step % every, *(x for x in (led.store_every[-1:] + led.memory_every[-1:]) if x)])
            led.productive += due * a.step_s
            step += due
            detect = 0.0
        else:
            detect = a.crash_detect_s
        led.detection += detect
        t += detect
        host_lost = cause.host_lost  # a peer's copy restores its ranks under memory+peer
        if cause.host_lost:
            broken[host_name] = cause
            if variant == "memory":
                memory.clear()  # that host's snapshots went with it; the others' alone restore nothing
        if cause.kind == "sdc":  # the saves before the corruption: none after it passed the replica check
            store[:] = [s for s in store if s.step <= corrupted_at]
            memory[:] = [s for s in memory if s.step <= corrupted_at]
        incident = Incident(
            kind=cause.kind,
            detail=cause.name,
            node=host_name if cause.host_lost else None,
            step=step,
            attempt=attempt,
            error="StoreUnavailable" if cause.kind == "error" else None,
            host_health=f"{cause.name}: the GPU fails its health check" if cause.nvml_sees and gpu_health else None,
        )
        decision = after_attempt(incident, incidents, profile)
        incidents.append(incident)
        records.append(
            AttemptRecord(
                attempt=attempt, launched_at=launched, first_step_at=first_step_at, ended_at=t, incident=incident
            )
        )
        if decision.action == "stop":
            raise SystemExit(f"the policy stopped the run at attempt {attempt}: {decision.line()}")
        queue = 0.0
        if decision.exclude_node:  # a spare takes its place: the job keeps its size
            broken.pop(decision.exclude_node, None)
            hosts[hosts.index(int(decision.exclude_node))] = spare
            spare += 1
            queue = a.replace_s
            led.replaced += 1
        decision_wait = (retry_delay_s(incidents, profile.train.retry_delay_s), queue)
        # progress past the state the retry resumes from is trained again
        kept = restore_order(store, memory if variant != "store" else [], lambda s: s.step)
        back_to = kept[0][0].step if kept else 0
        lost = max(0, step - back_to) * a.step_s
        led.productive -= lost
        led.wasted_progress += lost
        step = back_to
    overshoot = led.wall() - end  # the last step or wait may pass the end
    led.productive -= max(0.0, overshoot)
    return led


def summarize(ledgers: list[Ledger], clean: list[Ledger]) -> dict[str, tuple[float, float]]:
    """Median and spread (max - min) over the seeds of each figure."""

    def spread(values: list[float]) -> tuple[float, float]:
        return statistics.median(values), max(values) - min(values)

    out = {
        "goodput": spread([x.productive / x.wall() for x in ledgers]),
        "vs_clean": spread([x.productive / y.productive for x, y in zip(ledgers, clean, strict=True)]),
        "failures": spread([float(x.failures) for x in ledgers]),
        "replaced": spread([float(x.replaced) for x in ledgers]),
    }
    for b in Ledger.BUCKETS:
        out[b] = spread([getattr(x, b) / x.wall() for x in ledgers])
    for tier in ("memory", "store"):
        out[f"from_{tier}"] = spread([x.recoveries[tier] / max(1, sum(x.recoveries.values())) for x in ledgers])
    out["store_every"] = spread([statistics.median(x.store_every) if x.store_every else 0.0 for x in ledgers])
    out["memory_every"] = spread([statistics.median(x.memory_every) if x.memory_every else 0.0 for x in ledgers])
    return out


def main(argv: list[str] | None = None, say: Callable[[str], None] = print) -> dict[tuple[int, str], dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", default="1024,16384,102400", help="GPU counts, comma-separated (multiples of 8)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--days", type=float, default=LLAMA3_DAYS)
    for f in fields(Assumptions):
        if isinstance(f.default, float):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=f.default)
    args = p.parse_args(argv)
    a = Assumptions(**{f.name: getattr(args, f.name) for f in fields(Assumptions) if isinstance(f.default, float)})
    scales = [int(s) for s in args.scales.split(",")]
    if any(s < 2 * GPUS_PER_HOST or s % GPUS_PER_HOST for s in scales):
        raise SystemExit(f"--scales: GPU counts of at least {2 * GPUS_PER_HOST}, multiples of {GPUS_PER_HOST}")
    say(
        f"Assumptions: step {a.step_s:g} s; {a.state_bytes / 1e6:.0f} MB of state a GPU; a save blocks "
        f"{a.blocking_s() * 1e3:.1f} ms; commit {a.commit_s('store'):.2f} s to the store, "
        f"{a.commit_s('memory'):.2f} s to memory; restore {a.restore_s('store'):.2f} s from the store, "
        f"{a.restore_s('memory'):.2f} s from memory ({a.restore_s('memory', True):.2f} s from a peer); startup "
        f"{a.startup_s:g} s; a spare host {a.replace_s:g} s; {args.days:g} days; {args.seeds} seed(s)"
    )
    results: dict[tuple[int, str], dict] = {}
    for gpus in scales:
        mtbf_min = 1 / (FAILURES_PER_GPU_S * gpus) / 60
        say(f"\n{gpus:,} GPUs ({gpus // GPUS_PER_HOST:,} hosts): a failure every {mtbf_min:.0f} min on average")
        say(
            f"  {'variant':<12} {'goodput':>15} {'vs clean':>15} {'failures':>8} {'spares':>6}  "
            + " ".join(f"{b[:10]:>10}" for b in Ledger.BUCKETS)
            + f"  {'from mem':>8} {'every st/mem':>12}"
        )
        faults = [draw_faults(gpus, args.days, seed) for seed in range(args.seeds)]  # the same for each variant
        clean = [simulate(gpus, "store", [], a, args.days)] * args.seeds  # the baseline
        rows: list[tuple[str, Variant, bool]] = [(v, v, True) for v in VARIANTS]
        rows.append(("store, 2nd", "store", False))  # the baseline of the GPU health read: second failure only
        for label, variant, gpu_health in rows:
            t0 = time.perf_counter()
            runs = [simulate(gpus, variant, f, a, args.days, gpu_health) for f in faults]
            s = summarize(runs, clean)
            results[(gpus, label)] = s
            say(
                f"  {label:<12} {s['goodput'][0]:>7.4f} ±{s['goodput'][1] / 2:<6.4f} "
                f"{s['vs_clean'][0]:>7.4f} ±{s['vs_clean'][1] / 2:<6.4f} {s['failures'][0]:>8.0f} "
                f"{s['replaced'][0]:>6.0f}  "
                + " ".join(f"{s[b][0] * 100:>9.3f}%" for b in Ledger.BUCKETS)
                + f"  {s['from_memory'][0] * 100:>7.0f}% {s['store_every'][0]:>6.0f}/{s['memory_every'][0]:<5.0f}"
                + f"  ({time.perf_counter() - t0:.0f} s)"
            )
    say(
        "\ngoodput: steps kept x step time over the wall (± half the spread over the seeds); vs clean: over the "
        "store variant's goodput without faults (the baseline, simulated here); buckets: shares of the wall; from "
        "mem: resumes from host memory; every st/mem: the median interval in steps the schedules chose; "
        "store, 2nd: without the GPU health read after a fault (a broken host left out at its second failure). "
        "memory+peer: the memory tier as built, with its copy on a peer host."
    )
    return results


if __name__ == "__main__":
    main()
