"""What the preflight stage costs around its probes, through the local launcher and through a two-node Slurm job.

In one run, interleaved rounds of the same tiny profile's preflight stage (2 gloo ranks, the CPU GEMM, the
all-reduce and pairwise tests, the store check) through ``trainer.launch.launch``:
1. local: this machine's supervisor under torchrun, 1 node × 2 ranks (the baseline);
   local-2: the same work as the Slurm job's, 2 nodes × 1 rank, both nodes' torchrun agents on this machine
   (``cluster.simulate_nodes``): what two nodes' interpreters cost when they share these cores;
2. slurm: one sbatch job on the two-node Slurm cluster that ``tests/slurm_cluster.py`` starts here (node0 and
   node1, each in a host of its own), 2 nodes × 1 rank, whose srun starts
   ``python -m trainpipe.trainer.supervise.host --stage preflight`` on each node;
3. empty: an sbatch job over the same two nodes whose srun runs ``true``, followed the same way (squeue every
   0.2 s): what Slurm's scheduling and a job's start and end cost by themselves.

For each, the stage's wall time in the orchestrator against the probes' own time (the report's
``duration_s``: from the ranks' process group to the report); the rest is launching, scheduling, the
interpreter and torch's import, and teardown. Printed as medians; then the Slurm preflight's time beyond its
probes and beyond the empty job (the target: at most 5 s), and its time beyond the probes as a ratio against the
local launcher's, all measured in the same run.

    .venv/bin/python benchmarks/preflight_cluster.py [--rounds 5]     (as root, with slurm-wlm and munge)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import slurm_cluster  # noqa: E402 - the repository's own helpers, after its root is importable
from tests.conftest import TINY  # noqa: E402
from trainpipe.trainer.launch import launch  # noqa: E402
from trainpipe.trainer.launcher import LaunchRequest, Watch  # noqa: E402
from trainpipe.trainer.profile_files import load_profile  # noqa: E402


def one(kind: str) -> tuple[float, float]:
    """(wall seconds in the orchestrator, the probes' own seconds) of one preflight through ``kind``."""
    layout = ["cluster.nodes=2", "cluster.procs_per_node=1"] if kind != "local" else []
    layout += ["cluster.simulate_nodes=true"] if kind == "local-2" else []
    launcher = "slurm" if kind == "slurm" else "local"
    sets = [*TINY, *layout, "tracking.enabled=false", f"launcher.kind={launcher}", "launcher.poll_s=0.2"]
    prof = load_profile("local", sets)
    t0 = time.monotonic()
    outcome = launch(LaunchRequest("preflight", prof, f"bench-{kind}"), Watch())
    wall = time.monotonic() - t0
    if outcome.report is None:
        raise SystemExit(f"{kind}: the preflight failed: {outcome.incident.line() if outcome.incident else '?'}")
    return wall, float(outcome.report["duration_s"])


def empty_job(folder: Path) -> tuple[float, float]:
    """(wall seconds, 0) of an sbatch job over both nodes that runs ``true``, followed as the launcher follows."""
    script = folder / "empty.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --output={folder}/empty-%j.out\nsrun true\n")
    t0 = time.monotonic()
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True).stdout
    while subprocess.run(["squeue", "-h", "-j", job_id.strip(), "-o", "%T"], capture_output=True, text=True).stdout:
        time.sleep(0.2)
    return time.monotonic() - t0, 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each launcher")
    args = ap.parse_args()
    if why := slurm_cluster.available():
        raise SystemExit(f"no Slurm cluster here: {why}")
    with tempfile.TemporaryDirectory(prefix="tp-bench-preflight-") as tmp:
        os.environ["TRAINPIPE_HOME"] = str(Path(tmp, "home"))
        with slurm_cluster.cluster(Path(tmp, "slurm"), nodes=2) as cluster:
            os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
            times: dict[str, list[tuple[float, float]]] = {"local": [], "local-2": [], "slurm": [], "empty": []}
            one("local")  # warm the page cache and the store's folders; not counted
            for _ in range(args.rounds):
                for kind in times:
                    times[kind].append(empty_job(Path(tmp)) if kind == "empty" else one(kind))
    print(f"preflight stage, 2 gloo ranks on {os.cpu_count()} cores, {args.rounds} interleaved rounds (medians)")
    print(f"{'launcher':<9} {'wall s':>8} {'probes s':>9} {'beyond s':>9}")
    beyond = {}
    for kind, runs in times.items():
        wall, probes = statistics.median(w for w, _ in runs), statistics.median(p for _, p in runs)
        beyond[kind] = statistics.median(w - p for w, p in runs)
        print(f"{kind:<9} {wall:8.2f} {probes:9.2f} {beyond[kind]:9.2f}")
    print(f"slurm preflight beyond its probes and Slurm's own job (empty): {beyond['slurm'] - beyond['empty']:.2f} s")
    print(f"time beyond the probes, slurm / local: {beyond['slurm'] / beyond['local']:.2f}")
    same = beyond["slurm"] / beyond["local-2"]
    print(f"time beyond the probes, slurm / local-2 (the same two nodes' work on these cores): {same:.2f}")


if __name__ == "__main__":
    main()
