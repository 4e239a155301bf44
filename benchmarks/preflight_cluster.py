"""What the preflight stage costs around its probes, through the local launcher and through a Slurm job.

In one run, interleaved rounds of the same tiny profile's preflight stage (2 gloo ranks, the CPU GEMM, the
all-reduce and pairwise tests, the store check) through ``trainer.launch.launch``:
1. local: this machine's supervisor under torchrun (the baseline);
2. slurm: one sbatch job on the one-node Slurm cluster that ``tests/slurm_cluster.py`` starts here, whose srun
   starts ``python -m trainer.supervise.host --stage preflight``.

For each, the stage's wall time in the orchestrator against the probes' own time (the report's
``duration_s``: from the ranks' process group to the report); the rest is launching, scheduling, the
interpreter and torch's import, and teardown. Printed as medians, and the Slurm launcher's overhead beyond the
probes as a ratio against the local launcher's, measured in the same run.

    .venv/bin/python benchmarks/preflight_cluster.py [--rounds 5]     (as root, with slurm-wlm and munge)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import slurm_cluster  # noqa: E402 - the repository's own helpers, after its root is importable
from tests.conftest import TINY  # noqa: E402
from trainer.config import load_profile  # noqa: E402
from trainer.launch import launch  # noqa: E402
from trainer.launcher import LaunchRequest, Watch  # noqa: E402


def one(kind: str) -> tuple[float, float]:
    """(wall seconds in the orchestrator, the probes' own seconds) of one preflight through ``kind``."""
    sets = [*TINY, "tracking.enabled=false", f"launcher.kind={kind}", "launcher.poll_s=0.2"]
    prof = load_profile("local", sets)
    t0 = time.monotonic()
    outcome = launch(LaunchRequest("preflight", prof, f"bench-{kind}"), Watch())
    wall = time.monotonic() - t0
    if outcome.result is None:
        raise SystemExit(f"{kind}: the preflight failed: {outcome.incident.line() if outcome.incident else '?'}")
    return wall, float(outcome.result["duration_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each launcher")
    args = ap.parse_args()
    if why := slurm_cluster.available():
        raise SystemExit(f"no Slurm cluster here: {why}")
    with tempfile.TemporaryDirectory(prefix="tp-bench-preflight-") as tmp:
        os.environ["TRAINPIPE_HOME"] = str(Path(tmp, "home"))
        with slurm_cluster.cluster(Path(tmp, "slurm")) as (env, _pids):
            os.environ["SLURM_CONF"] = env["SLURM_CONF"]
            times: dict[str, list[tuple[float, float]]] = {"local": [], "slurm": []}
            one("local")  # warm the page cache and the store's folders; not counted
            for _ in range(args.rounds):
                for kind in times:
                    times[kind].append(one(kind))
    print(f"preflight stage, 2 gloo ranks on {os.cpu_count()} cores, {args.rounds} interleaved rounds (medians)")
    print(f"{'launcher':<9} {'wall s':>8} {'probes s':>9} {'beyond s':>9}")
    beyond = {}
    for kind, runs in times.items():
        wall, probes = statistics.median(w for w, _ in runs), statistics.median(p for _, p in runs)
        beyond[kind] = statistics.median(w - p for w, p in runs)
        print(f"{kind:<9} {wall:8.2f} {probes:9.2f} {beyond[kind]:9.2f}")
    print(f"time beyond the probes, slurm / local: {beyond['slurm'] / beyond['local']:.2f}")


if __name__ == "__main__":
    main()
