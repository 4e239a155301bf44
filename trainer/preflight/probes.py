"""Preflight probes, run on every rank under torchrun: ``python -m trainpipe.trainer.preflight``.

Each check yields ``{"name", "status": pass|warn|fail|skip, "detail", ...}``; rank 0
gathers them into one JSON report. What a report means for the run (stop,
exclude nodes, go on) is decided elsewhere (``trainer.preflight.report``,
``trainer.orchestrate.policy``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from trainpipe.trainer.checkpoint.flash import not_for
from trainpipe.trainer.checkpoint.memory_tier import SHARED_MEMORY, room_free, room_needed
from trainpipe.trainer.config import GPT_FACTORY, Profile
from trainpipe.trainer.device import Distributed, init_distributed
from trainpipe.trainer.drills import throttle
from trainpipe.trainer.parallel_dims import Layout
from trainpipe.trainer.preflight import gpu_health
from trainpipe.trainer.preflight.report import nodes_of
from trainpipe.trainer.proc import die_with_parent, node_name
from trainpipe.trainer.profile_files import load_resolved_profile
from trainpipe.trainer.protocol import result_path, write_file
from trainpipe.trainer.store import filesystem, is_local, local_path, open_binary, remove
from trainpipe.trainer.store_paths import join

COMPUTE_TRIES = 3  # measurements before a rank that looks slow fails the compute check


def check(name: str, ok: bool, detail: str, warn: bool = False, **extra: Any) -> dict[str, Any]:
    return {"name": name, "status": "pass" if ok else ("warn" if warn else "fail"), "detail": detail, **extra}


SYSCTLS = {
    "vm.overcommit_memory": "/proc/sys/vm/overcommit_memory",
    "vm.swappiness": "/proc/sys/vm/swappiness",
    "kernel.numa_balancing": "/proc/sys/kernel/numa_balancing",
    "net.core.rmem_max": "/proc/sys/net/core/rmem_max",
    "net.core.wmem_max": "/proc/sys/net/core/wmem_max",
    "transparent_hugepage": "/sys/kernel/mm/transparent_hugepage/enabled",
    "cpu.governor": "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor",
}
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "CUDA_DEVICE_MAX_CONNECTIONS", "OMP_NUM_THREADS")
OVERRIDES_ENV = "TRAINPIPE_PREFLIGHT_OVERRIDES"  # tests and drills: {"RANK": {fact: value}} stands in for another node


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def rank_facts(gpu_driver: str | None) -> dict[str, Any]:
    from trainpipe import trainer

    nccl = None
    if torch.cuda.is_available():
        try:
            from torch.cuda import nccl as nccl_library

            nccl = ".".join(map(str, nccl_library.version()))
        except Exception:  # noqa: BLE001 - NCCL absent from this build
            nccl = None
    facts = {
        "rank": dist.get_rank(),
        "host": node_name(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "trainpipe": getattr(trainer, "__version__", _dist_version()),
        "driver": gpu_driver,
        "sysctl": {k: _read(v) for k, v in SYSCTLS.items()},
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
    }
    overrides = json.loads(os.environ.get(OVERRIDES_ENV) or "{}").get(str(dist.get_rank()), {})
    for key, value in overrides.items():
        section, _, sub = key.partition(".")
        if section in ("sysctl", "env") and sub:
            facts[section][sub] = value
        else:
            facts[key] = value
    return facts


def _dist_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainpipe")
    except PackageNotFoundError:
        return "source"


def check_consistency(facts: list[dict[str, Any]], profile: Profile) -> list[dict[str, Any]]:
    """Every fact that differs between nodes, with which nodes hold which value."""
    must_match = set(profile.preflight.consistency_fail)
    flat: list[tuple[str, dict[str, Any]]] = []
    for f in facts:
        values = {k: f[k] for k in ("python", "torch", "cuda", "nccl", "trainpipe", "driver")}
        values.update({f"sysctl.{k}": v for k, v in f["sysctl"].items()})
        values.update({f"env.{k}": v for k, v in f["env"].items()})
        flat.append((f["host"], values))
    keys = sorted({k for _, v in flat for k in v})
    out, differing = [], []
    for key in keys:
        by_value: dict[str, set[str]] = {}
        for host, values in flat:
            by_value.setdefault(str(values.get(key)), set()).add(host)
        short = key.split(".", 1)[0] if key.startswith(("sysctl.", "env.")) else key
        if key in ("python", "torch", "cuda", "nccl", "trainpipe", "driver"):
            detail = (
                f"{next(iter(by_value))} on all nodes"
                if len(by_value) == 1
                else "; ".join(f"{v} on {', '.join(sorted(h))}" for v, h in sorted(by_value.items()))
            )
            out.append(
                check(
                    f"versions.{key}",
                    len(by_value) == 1,
                    detail,
                    warn=key not in must_match,
                    nodes={v: sorted(h) for v, h in by_value.items()},
                )
            )
        elif len(by_value) > 1:
            differing.append((key, short, by_value))
    for group in ("sysctl", "env"):
        rows = [(k, v) for k, short, v in differing if short == group]
        fatal = any(k in must_match or k.split(".", 1)[1] in must_match for k, _ in rows)
        detail = "; ".join(
            f"{k}: " + ", ".join(f"{v} on {'+'.join(sorted(h))}" for v, h in sorted(by.items())) for k, by in rows
        )
        out.append(
            check(
                f"consistency.{group}",
                not rows,
                detail or f"same on all {len({h for h, _ in flat})} node(s)",
                warn=not fatal,
                differences={k: {v: sorted(h) for v, h in by.items()} for k, by in rows},
            )
        )
    return out


def slow_ranks(seconds: list[float], max_slowdown: float) -> list[tuple[int, float, float]]:
    """(rank, its time, the median of the others' times) for each rank slower than the median of the others by
    more than ``max_slowdown``. Leave-one-out: with the rank itself in the median, a slow rank at world size 2
    would hide behind its own time."""
    others = [statistics.median([u for q, u in enumerate(seconds) if q != r] or [t]) for r, t in enumerate(seconds)]
    return [(r, t, others[r]) for r, t in enumerate(seconds) if t > others[r] * (1 + max_slowdown)]


def best_of_confirmations(
    measure: Callable[[], list[float]], max_slowdown: float, tries: int = COMPUTE_TRIES
) -> list[float]:
    """Each rank's best time over up to ``tries`` measurements, measuring again while some rank looks slow.

    Noise only ever adds time, and a neighbour's burst (a server starting, the orchestrator sharding, two ranks
    sharing a core's siblings) can cover every round of one measurement; a throttled or faulty device is slow
    in every one. So a rank fails only when it stays slow after ``tries`` measurements, and a healthy run pays
    for one."""
    best = measure()
    for _ in range(tries - 1):
        if not slow_ranks(best, max_slowdown):
            break
        best = [min(a, b) for a, b in zip(best, measure(), strict=True)]
    return best


def check_compute(profile: Profile, device: torch.device, hosts: list[str]) -> dict[str, Any]:
    """A fixed GEMM on every rank; a rank slower than the median of the others by more than
    max_compute_slowdown, in every one of up to three measurements, fails (``best_of_confirmations``)."""
    n = profile.preflight.gemm_n or (4096 if device.type == "cuda" else 384)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        _ = a @ b  # warm-up: kernels, caches, clocks
    if device.type == "cuda":
        torch.cuda.synchronize()
    # The best of several rounds: a neighbour's work (a server, the orchestrator sharding beside the preflight)
    # lengthens some rounds, while a throttled or faulty device is slow in all of them. On a CPU a round is one
    # GEMM (about a millisecond), shorter than the scheduler's time slice, so even while neighbours keep every
    # core busy some rounds run with the core to themselves.
    iters, rounds = (10, 5) if device.type == "cuda" else (1, 50)

    def measure() -> list[float]:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(iters):
                _ = a @ b
            if device.type == "cuda":
                torch.cuda.synchronize()
            throttle(profile.faults, dist.get_rank(), time.perf_counter() - t0)  # drills: a slowed rank takes longer
            best = min(best, time.perf_counter() - t0)
        gathered: list[float] = [0.0] * dist.get_world_size()
        dist.all_gather_object(gathered, best / iters)
        return gathered  # the same list on every rank, so every rank takes the same branch in the loop above

    seconds = best_of_confirmations(measure, profile.preflight.max_compute_slowdown)
    times = list(zip(seconds, hosts, strict=True))
    slow = [(r, t, hosts[r], base) for r, t, base in slow_ranks(seconds, profile.preflight.max_compute_slowdown)]
    per_rank = {r: round(2 * n**3 / t / 1e12, 4) for r, (t, _) in enumerate(times)}
    if slow:
        detail = (
            "; ".join(
                f"rank {r} on {h} takes {t * 1000:.1f} ms per {n}x{n} GEMM, "
                f"{t / base:.2f}x the median of the other ranks {base * 1000:.1f} ms"
                for r, t, h, base in slow
            )
            + f" (limit +{profile.preflight.max_compute_slowdown:.0%}): a throttled or faulty device"
        )
    else:
        detail = (
            f"{n}x{n} GEMM: {min(per_rank.values()):.3f}-{max(per_rank.values()):.3f} TFLOP/s per rank, "
            f"each within {profile.preflight.max_compute_slowdown:.0%} of the median of the others"
        )
    return check(
        "compute.gemm",
        not slow,
        detail,
        tflops=per_rank,
        ranks=[r for r, *_ in slow],
        nodes=sorted({h for _, _, h, _ in slow}),
        local_tflops=per_rank[dist.get_rank()],
    )


def _time_allreduce(numel: int, device: torch.device, iters: int = 3) -> tuple[float, bool]:
    x = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(x)  # warm-up: connection setup is not bandwidth
    ok = bool(torch.allclose(x, torch.full_like(x, float(dist.get_world_size()))))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters, ok


def check_allreduce(profile: Profile, device: torch.device) -> dict[str, Any]:
    """All-reduce at several sizes; bandwidth as nccl-tests reports it (busbw = algbw × 2(n-1)/n)."""
    n = dist.get_world_size()
    top = profile.preflight.allreduce_mb
    sizes, rows, ok_values = [top / 64, top / 8, top], [], True
    for mb in sizes:
        numel = max(1, int(mb * (1 << 20) / 4))
        seconds, ok = _time_allreduce(numel, device)
        ok_values &= ok
        algbw = numel * 4 / seconds / 1e9
        rows.append(
            {
                "mb": round(mb, 4),
                "ms": round(seconds * 1000, 3),
                "algbw_gbps": round(algbw, 3),
                "busbw_gbps": round(algbw * 2 * (n - 1) / n, 3),
            }
        )
    big = rows[-1]
    ms_limit, bw_limit = profile.preflight.max_allreduce_ms, profile.preflight.min_busbw_gbps
    too_slow = ms_limit is not None and big["ms"] > ms_limit
    too_thin = bw_limit is not None and big["busbw_gbps"] < bw_limit
    detail = ", ".join(f"{r['mb']:g} MB {r['ms']:.1f} ms busbw {r['busbw_gbps']:.2f} GB/s" for r in rows)
    if not ok_values:
        detail = "all-reduce returned wrong values: " + detail
    if too_slow:
        detail += f" (slower than preflight.max_allreduce_ms={ms_limit})"
    if too_thin:
        detail += f" (below preflight.min_busbw_gbps={bw_limit})"
    return check(
        "collective.allreduce",
        ok_values and not too_slow and not too_thin,
        detail,
        sizes=rows,
        ms=big["ms"],
        algbw_gbps=big["algbw_gbps"],
        busbw_gbps=big["busbw_gbps"],
    )


def mesh_groups(layout: Layout, dims: tuple[str, ...]) -> list[list[int]]:
    """The rank groups of mesh dimensions ``dims``: ranks whose coordinates differ only there, in rank order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(layout.world_size):
        c = layout.coordinates(r)
        groups.setdefault(tuple(v for k, v in c.items() if k not in dims), []).append(r)
    return sorted(groups.values())


MESH_DIMS = {"tp": ("tp",), "dp": ("dp_replicate", "dp_shard"), "pp": ("pp",)}


def check_allreduce_per_dim(profile: Profile, device: torch.device) -> list[dict[str, Any]]:
    """Under a layout: the all-reduce of each mesh dimension's groups (the tp groups, the data-parallel groups)
    at once, each group timing its own; a group well below its dimension's median is a warning naming its
    ranks (a slow link inside a node shows in tp, one between nodes in dp). pp's stages only send to their
    neighbours: the pairwise test times those links."""
    layout, rank = profile.layout, dist.get_rank()
    numel = max(1, int(profile.preflight.allreduce_mb * (1 << 20) / 4))
    out = []
    for name in ("tp", "dp"):
        groups = mesh_groups(layout, MESH_DIMS[name])
        if len(groups[0]) < 2:
            continue
        mine = None
        for g in groups:  # every rank takes part in making every group
            made = dist.new_group(g)
            if rank in g:
                mine = (g, made)
        assert mine is not None  # the groups of a dimension cover every rank
        group_ranks, group = mine
        x = torch.ones(numel, dtype=torch.float32, device=device)
        dist.all_reduce(x, group=group)  # warm-up: connection setup is not bandwidth
        dist.barrier()
        timed = []
        for _ in range(3):
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            timed.append(time.perf_counter() - t0)
        # The best of three: a slow link is slow every time, while a rank descheduled once on a busy host (the
        # groups share its cores) made one group's mean look half as fast as the other's.
        seconds = min(timed)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (group_ranks, seconds))
        n = len(group_ranks)
        busbw = {tuple(g): numel * 4 / t / 1e9 * 2 * (n - 1) / n for g, t in every}  # a group's ranks agree
        median = statistics.median(busbw.values())
        slow = [g for g, bw in busbw.items() if bw < median / 2]
        detail = f"{len(busbw)} {name} group(s) of {n}: busbw {min(busbw.values()):.2f}-{max(busbw.values()):.2f} GB/s"
        if slow:
            detail = f"slow {name} group(s) (under half the median busbw): " + "; ".join(
                f"ranks {list(g)} {busbw[g]:.2f} GB/s" for g in slow
            )
        groups_bw = {",".join(map(str, g)): round(bw, 3) for g, bw in busbw.items()}
        out.append(check(f"collective.allreduce.{name}", not slow, detail, warn=True, busbw_gbps=groups_bw))
    return out


def pipeline_pairs(layout: Layout) -> list[tuple[int, int]]:
    """The links a pipeline sends over: each rank to the same place in the next stage."""
    per_stage = layout.world_size // layout.pp
    return [(r, r + per_stage) for r in range(layout.world_size - per_stage)]


def check_pairwise(profile: Profile, device: torch.device) -> dict[str, Any]:
    """Each rank's link to its ring neighbour (under pp: to its peer in the next pipeline stage, the links the
    pipeline uses), one pair at a time: localises a slow link or node."""
    n, rank = dist.get_world_size(), dist.get_rank()
    numel = max(1, int(profile.preflight.allreduce_mb * (1 << 20) / 4))
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    layout = profile.layout
    pairs = pipeline_pairs(layout) if layout.pp > 1 else [(src, (src + 1) % n) for src in range(n)]
    results = []
    for src, dst in pairs:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(2):  # ping-pong: both directions of the link
            if rank == src:
                dist.send(buf, dst)
                dist.recv(buf, dst)
            elif rank == dst:
                dist.recv(buf, src)
                dist.send(buf, src)
        results.append((src, dst, time.perf_counter() - t0))
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, results)
    # each pair as its sender timed it (a rank outside a pair only passes the barrier: its time says nothing)
    pair_s = {(s, d): t for r, timed in enumerate(gathered) for s, d, t in timed if s == r}
    gbps = {f"{s}->{d}": round(4 * numel * 4 / t / 1e9, 3) for (s, d), t in pair_s.items()}
    median = statistics.median(pair_s.values())
    slow = [f"{s}<->{d}" for (s, d), t in pair_s.items() if t > 2 * median]
    detail = (
        ("slow links (over 2x the median pair time): " + ", ".join(slow))
        if slow
        else f"{len(pair_s)} {'pipeline' if layout.pp > 1 else 'neighbour'} link(s): "
        f"{min(gbps.values()):.2f}-{max(gbps.values()):.2f} GB/s"
    )
    return check("collective.pairwise", not slow, detail, warn=True, gbps=gbps)


def check_store(profile: Profile) -> list[dict[str, Any]]:
    """The object store round trip, then (when it works) local free disk and /dev/shm."""
    out = [check_store_roundtrip(profile)]
    if out[0]["status"] == "fail":
        return out
    if is_local(profile.store.root):
        out.append(check_free_disk(profile))
    if os.path.isdir("/dev/shm"):
        out.append(check_shm(profile))
    return out


def check_store_roundtrip(profile: Profile) -> dict[str, Any]:
    """Write, read back and delete ``preflight.store_probe_mb`` under the store root, timed."""
    root, so = profile.store.root, profile.store.storage_options
    size = int(profile.preflight.store_probe_mb * (1 << 20))
    payload = os.urandom(size)
    try:
        fs, base = filesystem(root, so)
        probe = join(base, f".preflight-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}")
        fs.makedirs(base, exist_ok=True)
        t0 = time.perf_counter()
        with open_binary(fs, probe, "wb") as fh:
            fh.write(payload)
        t1 = time.perf_counter()
        with fs.open(probe, "rb") as fh:
            back = fh.read()
        t2 = time.perf_counter()
        remove(fs, probe)
    except Exception as exc:  # noqa: BLE001 - any backend failure is the finding
        msg = str(exc).splitlines()[0] if str(exc) else ""
        return check(
            "store.roundtrip", False, f"{root}: {exc.__class__.__name__}: {msg}; check store.root and credentials"
        )
    write, read = size / max(t1 - t0, 1e-9) / 1e6, size / max(t2 - t1, 1e-9) / 1e6
    ok = back == payload
    detail = f"{root}: wrote {write:.0f} MB/s, read {read:.0f} MB/s" + ("" if ok else "; bytes read back differ")
    return check("store.roundtrip", ok, detail, write_mbps=write, read_mbps=read)


def check_free_disk(profile: Profile) -> dict[str, Any]:
    path = local_path(profile.store.root)
    free_gb = shutil.disk_usage(path).free / 1e9
    need = max(profile.preflight.min_free_disk_gb, expected_checkpoints_gb(profile))
    detail = (
        f"{free_gb:.1f} GB free at {path} (need {need:.2f} GB: "
        "max of preflight.min_free_disk_gb and checkpoint.keep_last+1 checkpoints)"
    )
    return check("store.free_disk", free_gb >= need, detail, free_gb=free_gb)


def check_shm(profile: Profile) -> dict[str, Any]:
    shm_gb = shutil.disk_usage("/dev/shm").total / 1e9
    want = profile.preflight.min_shm_gb
    detail = f"/dev/shm is {shm_gb:.1f} GB (want {want:g} GB for NCCL and data loaders)"
    return check("host.shm", shm_gb >= want, detail, warn=True, shm_gb=shm_gb)


def expected_state_bytes(profile: Profile) -> float:
    """The built-in GPT's state as a checkpoint holds it: fp32 weights and AdamW's two moments."""
    m = profile.model
    params = m.vocab_size * m.n_embd + m.block_size * m.n_embd + m.n_layer * 12 * m.n_embd**2
    return params * 12


def expected_checkpoints_gb(profile: Profile) -> float:
    """The state for the checkpoints kept plus the one being written."""
    return expected_state_bytes(profile) * (profile.checkpoint.keep_last + 1) / 1e9


def check_memory_tier_room(profile: Profile, d: Distributed) -> list[dict[str, Any]]:
    """With ``checkpoint.memory_every_steps`` on, on each host's first rank: whether this host's shared memory
    holds the tier's snapshots as the ranks count them before their first (``memory_tier.room_needed``). The
    profile gives the built-in GPT's state; a plug-in's is measured by the ranks then. A host without the
    room trains with the store alone: a warning here, before anything starts."""
    c = profile.cluster
    if profile.checkpoint.memory_every_steps == "off" or d.local_rank != 0 or not os.path.isdir(SHARED_MEMORY):
        return []
    if profile.model.factory != GPT_FACTORY:
        line = "a plug-in model's state is measured by the ranks before their first snapshot"
        return [{**check("memory_tier.room", True, line), "status": "skip", "node": node_name()}]
    state = expected_state_bytes(profile)
    replicated = profile.train.strategy == "ddp" and not profile.layout.meshed
    per_rank = state if replicated else state / c.world_size
    local = c.world_size if c.simulate_nodes else c.procs_per_node  # simulated nodes share this host
    flash = profile.checkpoint.memory_snapshot == "flash" and not not_for(sharded=not replicated)  # as the ranks
    need = room_needed(per_rank, local, c.nodes > 1, flash)
    free = room_free(SHARED_MEMORY, 0 if flash else per_rank, local)
    if need <= free:
        detail = (
            f"the memory tier's snapshots need about {need / 2**20:.0f} MB of shared memory; {free / 2**20:.0f} MB free"
        )
    else:
        detail = (
            f"the memory tier's snapshots need about {need / 2**20:.0f} MB of shared memory on {node_name()} and it "
            f"has {max(free, 0) / 2**20:.0f} MB free: the run will checkpoint to the store alone; free or enlarge "
            "/dev/shm, or set checkpoint.memory_every_steps=off"
        )
    return [check("memory_tier.room", need <= free, detail, warn=True, node=node_name(), need_mb=round(need / 2**20))]


def gpu_checks(profile: Profile, d: Distributed) -> tuple[list[dict[str, Any]], str | None]:
    """This node's GPU checks (on its local rank 0 only: the others would read the same devices) and driver."""
    if d.local_rank != 0:
        return [], None
    status, states = gpu_health.probe()
    checks = gpu_health.evaluate(states, profile.preflight) if states else [gpu_health.no_gpu_check(status)]
    if d.device.type == "cuda" and status not in ("ok", "recorded"):
        detail = f"the profile trains on CUDA but NVML says: {status}; check the driver on this node"
        checks = [check("gpu.nvml", False, detail)]
    for c in checks:
        c["node"] = node_name()
    return checks, next((s.get("driver_version") for s in states), None)


def run(profile: Profile) -> dict[str, Any]:
    """Every probe on this rank; every rank returns the same report."""
    timings: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        timings[name] = round(now - mark, 3)
        mark = now

    d = init_distributed(profile)
    lap("init")
    gpu, driver = gpu_checks(profile, d)
    facts, gathered_gpu = [None] * d.world_size, [None] * d.world_size
    dist.all_gather_object(facts, rank_facts(driver))
    dist.all_gather_object(gathered_gpu, gpu)
    checks = [c for per_rank in gathered_gpu for c in per_rank]  # type: ignore[union-attr]
    checks += check_consistency(facts, profile)  # type: ignore[arg-type]
    rooms: list[Any] = [None] * d.world_size
    dist.all_gather_object(rooms, check_memory_tier_room(profile, d))
    checks += [c for per_rank in rooms for c in per_rank]
    lap("facts_and_gpu")
    checks.append(check_compute(profile, d.device, [f["host"] for f in facts]))  # type: ignore[index]
    lap("compute")
    checks.append(check_allreduce(profile, d.device))
    if profile.layout.meshed:
        checks += check_allreduce_per_dim(profile, d.device)
    if profile.preflight.pairwise and d.world_size > 1:
        checks.append(check_pairwise(profile, d.device))
    lap("collective")
    if d.rank == 0:
        checks += check_store(profile)
    dist.barrier()
    lap("storage")
    dist.destroy_process_group()
    return {
        "ok": all(c["status"] != "fail" for c in checks),
        "world_size": len(facts),
        "nodes": sorted({f["host"] for f in facts}),  # type: ignore[index]
        "failing_nodes": sorted({n for c in checks if c["status"] == "fail" for n in nodes_of(c, facts)}),
        "ranks": facts,
        "checks": checks,
        "timings_s": timings,
        "duration_s": round(sum(timings.values()), 3),
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


@record
def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    p = argparse.ArgumentParser(prog="python -m trainpipe.trainer.preflight")
    p.add_argument("--profile", required=True)
    p.add_argument("--out-dir", required=True, help="Local folder where rank 0 writes the JSON report (result.json).")
    args = p.parse_args(argv)
    profile = load_resolved_profile(args.profile)
    torch.set_num_threads(profile.cluster.threads_per_proc)
    report = run(profile)
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:  # the report, which names every rank and node; its rank says whose it is, as a training result's
        write_file(result_path(args.out_dir), {**report, "rank": 0})
    elif int(os.environ.get("LOCAL_RANK", 0)) == 0:  # on another host: that host's part finished (a launcher reads it)
        write_file(result_path(args.out_dir, rank), {"rank": rank})
    return 0
