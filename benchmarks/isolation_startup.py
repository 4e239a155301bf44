"""What a single-host job's own network namespace costs at start-up (cluster.isolate, docs/security.md).

In one run, interleaved round by round on the same dataset: one training attempt of a tiny profile with
`cluster.isolate: true` and one with `false`, each cold (a fresh torchrun agent interpreter) and each warm
(forked from the run's warm host). The figure is the attempt's start-up: from the call to the first training
step's first beacon (the agent's start, the namespace, the rendezvous, the ranks' start, the model and the
resume). Printed per mode as the median over the rounds and as the ratio of isolated to not; also the cost
of entering a namespace alone (fork, unshare, loopback up) against a plain fork.

    .venv/bin/python benchmarks/isolation_startup.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "train.steps=2",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.eval_every=0",
    "train.eval_batches=1",
    "checkpoint.every_steps=100",
    "data.max_bytes=200000",
    "data.shard_tokens=65536",
    "tracking.enabled=false",
]


def fork_cost(enter: bool, rounds: int = 50) -> float:
    """Median seconds of a fork whose child (optionally) enters a network namespace, then exits."""
    from trainpipe.trainer.supervise.isolation import enter_namespace

    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            if enter:
                enter_namespace()
            os._exit(0)
        os.waitpid(pid, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ["TRAINPIPE_HOME"] = tempfile.mkdtemp(prefix="tp-isolation-")
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.profile_files import load_profile
    from trainpipe.trainer.supervise.attempt import train_attempt
    from trainpipe.trainer.supervise.isolation import probe
    from trainpipe.trainer.supervise.warm_host import keep_warm

    if (why := probe()) is not None:
        raise SystemExit(f"this host makes no network namespace ({why}): nothing to measure")
    base = load_profile("local", TINY)
    uri = shard_dataset(base.data, base.store).uri
    starts: dict[str, list[float]] = {}
    for warm in (False, True):
        with keep_warm(warm):
            for r in range(args.rounds):
                for isolate in (True, False) if r % 2 else (False, True):  # interleaved, alternating the order
                    prof = load_profile("local", [*TINY, f"cluster.isolate={str(isolate).lower()}",
                                                  f"cluster.warm_host={str(warm).lower()}"])  # fmt: skip
                    t0 = time.time()
                    out = train_attempt(prof, f"iso-{warm}-{isolate}-{r}", uri)
                    if out.result is None or out.first_step_at is None:
                        raise SystemExit(f"attempt failed: {out.incident.line() if out.incident else out.job.tail}")
                    starts.setdefault(f"{'warm' if warm else 'cold'} isolate={isolate}", []).append(
                        out.first_step_at - t0
                    )
    print(f"attempt start-up to the first step, median of {args.rounds} interleaved rounds (2-core host):")
    for mode in ("cold", "warm"):
        on, off = (statistics.median(starts[f"{mode} isolate={v}"]) for v in (True, False))
        print(f"  {mode}: isolated {on:.3f}s, host network {off:.3f}s, ratio {on / off:.3f}")
    plain, entered = fork_cost(False), fork_cost(True)
    print(f"fork + exit: {plain * 1e3:.2f} ms; fork + namespace + exit: {entered * 1e3:.2f} ms "
          f"(+{(entered - plain) * 1e3:.2f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
