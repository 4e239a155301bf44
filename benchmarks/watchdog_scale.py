"""The job watchdog at scale: 4,096 simulated ranks on 512 hosts, one planted fault of each class.

Each class runs as its own simulation in real time: a simulator thread plays
every rank's beacons (about 10 a rank a second: five phases a step at two steps
a second) into the job's ``BeaconServer`` through its ingestion function (the
path every received line takes after its socket, which this benchmark leaves
out), and a second thread polls the real ``Watchdog`` every ``watchdog.poll_s``,
as the supervisor does. One fault is planted per simulation:

- hang: one rank stops sending while the others wait in the step's collective;
- straggler: one rank computes 1.6x from a step on;
- network: every rank of one host waits 6x longer in its collectives;
- data_stall: one rank waits for its data most of each step;
- loss_spike: rank 0's loss 10x at one step (``on_loss_spike: warn``: the
  watchdog's own check).

Reported per class: whether the incident names the planted culprit, the time
from the fault's allowance (the moment the watchdog could first decide: the
hang allowance after the last beacon; the arrival of the last report of the
deciding window; the spike's report) to the incident, and the CPU seconds the
watchdog's polls used per wall second (and, apart, the ingestion's).

    .venv/bin/python benchmarks/watchdog_scale.py [--ranks 4096] [--per-host 8] [--seconds 40]

Targets (issue 25): every fault found and named, each within 1 s after its allowance, at most one core.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainpipe.trainer.config import WatchdogConfig
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.supervise.beacons import BeaconServer
from trainpipe.trainer.supervise.watchdog import Watchdog

STEP_S = 0.5  # two steps a second; five beacons a step: ten a rank a second
WINDOW, PATIENCE = 5, 2
FAULT_STEP = 3 * WINDOW + 1  # the first step of a window, after the baseline windows
CULPRIT, HOST_CULPRIT = 1234, 300


@dataclass
class Sim:
    kind: str
    ranks: int
    per_host: int
    allowance_at: float | None = None
    found: Incident | None = None
    found_at: float | None = None
    sent: int = 0
    ingest_cpu: float = 0.0
    watch_cpu: float = 0.0
    wall: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)

    def host(self, r: int) -> str:
        return f"node{r // self.per_host}"


def config(kind: str) -> WatchdogConfig:
    return WatchdogConfig(
        hang_timeout_s=5.0,
        straggler_window=WINDOW,
        straggler_patience=PATIENCE,
        health_window=10,
        on_loss_spike="warn",
        poll_s=0.5,
    )


def figures(sim: Sim, r: int, step: int) -> tuple[float, float, float, float]:
    """(data wait, compute, collective wait, loss) of rank ``r`` at ``step`` under the planted fault."""
    faulty = step >= FAULT_STEP
    data, compute, comm = 0.002, 0.3 * (1 + 0.02 * ((r * 7 + step) % 5)), 0.05
    if faulty and sim.kind == "straggler" and r == CULPRIT:
        compute *= 1.6
    if faulty and sim.kind == "network" and r // sim.per_host == HOST_CULPRIT:
        comm *= 6
    if faulty and sim.kind == "data_stall" and r == CULPRIT:
        data = 0.5
    loss = 2.0 - step * 0.001
    if sim.kind == "loss_spike" and step == FAULT_STEP:
        loss *= 10
    return data, compute, comm, loss


def simulate(sim: Sim, server: BeaconServer, steps: int) -> None:
    """Every rank's beacons of each step, as the loop sends them, paced at STEP_S a step."""
    record = server._record  # the ingestion of one decoded beacon
    cpu0, t0 = time.thread_time(), time.monotonic()
    for r in range(sim.ranks):
        record(r, -1, "start", time.time(), {"host": sim.host(r), "machine": "simulated"})
    decide = FAULT_STEP - 1 + PATIENCE * WINDOW  # the last step of the window that can decide
    for step in range(1, steps + 1):
        if sim.stop.is_set():
            break
        start = time.monotonic()
        hung = sim.kind == "hang" and step >= FAULT_STEP
        for r in range(sim.ranks):
            now = time.time()
            d, c, w, loss = figures(sim, r, step - 1)
            extra = {"l": loss, "g": 1.0, "dw": d, "cp": c, "cw": w} if step > 1 else {}
            record(r, step, "data", now, extra)
            record(r, step, "forward", now, {})
            sim.sent += 2
            if hung and r == CULPRIT:
                continue  # stuck in its forward: silent from here on
            record(r, step, "collective", now, {"n": 2 * step - 1, "c": "grads", "cs": figures(sim, r, step)[1]})
            sim.sent += 1
            if not hung:  # the others wait in the gradients' all-reduce for it
                record(r, step, "optimizer", now, {})
                record(r, step, "collective", now, {"n": 2 * step, "c": "loss"})
                sim.sent += 2
        if hung and step == FAULT_STEP and sim.allowance_at is None:
            sim.allowance_at = time.monotonic() + 5.0
        if step == decide and sim.kind == "straggler":
            sim.allowance_at = time.monotonic()  # compute rides on the step's own gradient beacon
        if step - 1 == decide and sim.kind in ("network", "data_stall"):
            sim.allowance_at = time.monotonic()  # the deciding window's last report is in
        if step - 1 == FAULT_STEP and sim.kind == "loss_spike":
            sim.allowance_at = time.monotonic()
        if hung:  # the others wait in the collective: nothing more to send
            sim.stop.wait(30)
            break
        time.sleep(max(0.0, STEP_S - (time.monotonic() - start)))
    sim.ingest_cpu, sim.wall = time.thread_time() - cpu0, time.monotonic() - t0


def watch(sim: Sim, dog: Watchdog) -> None:
    cpu0 = time.thread_time()
    seen = 0
    while not sim.stop.is_set():
        fatal = dog.check()
        new = [*dog.findings[seen:], *([fatal] if fatal is not None and fatal not in dog.findings else [])]
        seen = len(dog.findings)
        for f in new:
            if sim.found is None:
                sim.found, sim.found_at = f, time.monotonic()
                sim.stop.set()
        time.sleep(dog.cfg.poll_s)
    sim.watch_cpu = time.thread_time() - cpu0


def named(sim: Sim) -> bool:
    f = sim.found
    if f is None:
        return False
    return {
        "hang": f.kind == "hang" and f.rank == CULPRIT,
        "straggler": f.kind == "straggler" and f.rank == CULPRIT,
        "network": f.kind == "network" and f.node == sim.host(HOST_CULPRIT * sim.per_host),
        "data_stall": f.kind == "data_stall" and f.rank == CULPRIT,
        "loss_spike": f.kind == "loss_spike" and f.step == FAULT_STEP,
    }[sim.kind]


def run(kind: str, ranks: int, per_host: int, seconds: float) -> dict:
    server = BeaconServer(world_size=ranks)
    server.node = "simulated-head"  # the simulated ranks are on other hosts: never this machine's processes
    sim = Sim(kind, ranks, per_host)
    dog = Watchdog(config(kind), server, world_size=ranks)
    watcher = threading.Thread(target=watch, args=(sim, dog), daemon=True)
    t0 = time.monotonic()
    watcher.start()
    simulate(sim, server, int(seconds / STEP_S))
    sim.stop.wait(max(0.0, seconds - (time.monotonic() - t0)))
    sim.stop.set()
    watcher.join(timeout=10)
    wall = time.monotonic() - t0
    server.close()
    late = sim.found_at - sim.allowance_at if sim.found_at and sim.allowance_at else None
    return {
        "class": kind,
        "found": sim.found.line() if sim.found else None,
        "named": named(sim),
        "after_allowance_s": round(late, 3) if late is not None else None,
        "watchdog_cores": round(sim.watch_cpu / wall, 3),
        "ingest_cores": round(sim.ingest_cpu / wall, 3),
        "beacons_per_s": round(sim.sent / max(sim.wall, 1e-9)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--per-host", type=int, default=8)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--classes", default="hang,straggler,network,data_stall,loss_spike")
    args = p.parse_args()
    rows = [run(k, args.ranks, args.per_host, args.seconds) for k in args.classes.split(",")]
    for r in rows:
        print(json.dumps(r), flush=True)
    print()
    head = ("class", "named", "after allowance", "watchdog cores", "ingest cores", "beacons/s")
    print(f"{head[0]:<11} {head[1]:>5} {head[2]:>16} {head[3]:>15} {head[4]:>13} {head[5]:>10}")
    for r in rows:
        late = "-" if r["after_allowance_s"] is None else f"{r['after_allowance_s']:.2f} s"
        print(
            f"{r['class']:<11} {r['named']!s:>5} {late:>16} {r['watchdog_cores']:>15.3f} "
            f"{r['ingest_cores']:>13.3f} {r['beacons_per_s']:>10,}"
        )


if __name__ == "__main__":
    main()
