"""Preflight probes, run on every rank under torchrun: ``python -m trainer.preflight``.

Each check yields ``{"name", "status": pass|warn|fail, "detail", ...}``; rank 0
gathers them into one JSON report. A failing check stops the pipeline before
any training compute is spent.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import Profile, load_resolved_profile
from trainer.proc import die_with_parent
from trainer.store import filesystem, is_local, join, local_path


def check(name: str, ok: bool, detail: str, warn: bool = False, **extra: Any) -> dict[str, Any]:
    return {"name": name, "status": "pass" if ok else ("warn" if warn else "fail"), "detail": detail, **extra}


def rank_facts() -> dict[str, Any]:
    return {
        "rank": dist.get_rank(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def check_versions(facts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for key in ("python", "torch", "cuda"):
        values: dict[str, list[int]] = {}
        for f in facts:
            values.setdefault(str(f[key]), []).append(f["rank"])
        detail = ", ".join(f"{v} on ranks {r}" for v, r in values.items())
        out.append(check(f"versions.{key}", len(values) == 1, detail if len(values) > 1 else f"{next(iter(values))} on all ranks"))
    return out


def check_allreduce(profile: Profile, device: torch.device) -> dict[str, Any]:
    """Time an all-reduce round trip; report bandwidth as nccl-tests does (busbw = algbw × 2(n-1)/n)."""
    n = dist.get_world_size()
    numel = int(profile.preflight.allreduce_mb * (1 << 20) / 4)
    x = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(x)  # warm-up: connection setup is not bandwidth
    ok_values = bool(torch.allclose(x, torch.full_like(x, float(n))))
    iters = 3
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / iters * 1000
    algbw = x.numel() * 4 / (ms / 1000) / 1e9
    busbw = algbw * 2 * (n - 1) / n
    limit = profile.preflight.max_allreduce_ms
    ok = ok_values and (limit is None or ms <= limit)
    detail = f"{profile.preflight.allreduce_mb:g} MB in {ms:.1f} ms, busbw {busbw:.2f} GB/s"
    if not ok_values:
        detail = "all-reduce returned wrong values: " + detail
    elif not ok:
        detail += f" (slower than preflight.max_allreduce_ms={limit})"
    return check("collective.allreduce", ok, detail, ms=ms, algbw_gbps=algbw, busbw_gbps=busbw)


def check_store(profile: Profile) -> list[dict[str, Any]]:
    root, so = profile.store.root, profile.store.storage_options
    size = int(profile.preflight.store_probe_mb * (1 << 20))
    payload = os.urandom(size)
    out = []
    try:
        fs, base = filesystem(root, so)
        probe = join(base, f".preflight-{socket.gethostname()}-{os.getpid()}")
        fs.makedirs(base, exist_ok=True)
        t0 = time.perf_counter()
        with fs.open(probe, "wb") as fh:
            fh.write(payload)
        t1 = time.perf_counter()
        with fs.open(probe, "rb") as fh:
            back = fh.read()
        t2 = time.perf_counter()
        fs.rm(probe)
        ok = back == payload
        mbps = lambda s: size / max(s, 1e-9) / 1e6  # noqa: E731
        out.append(check("store.roundtrip", ok, f"{root}: wrote {mbps(t1 - t0):.0f} MB/s, read {mbps(t2 - t1):.0f} MB/s"
                         + ("" if ok else "; bytes read back differ"), write_mbps=mbps(t1 - t0), read_mbps=mbps(t2 - t1)))
    except Exception as exc:  # noqa: BLE001 - any backend failure is the finding
        msg = str(exc).splitlines()[0] if str(exc) else ""
        out.append(check("store.roundtrip", False, f"{root}: {exc.__class__.__name__}: {msg}; check store.root and credentials"))
        return out
    if is_local(root):
        free_gb = shutil.disk_usage(local_path(root)).free / 1e9
        need = profile.preflight.min_free_disk_gb
        out.append(check("store.free_disk", free_gb >= need, f"{free_gb:.1f} GB free at {local_path(root)} (need {need:g} GB)", free_gb=free_gb))
    return out


def run(profile: Profile) -> dict[str, Any]:
    t_start = time.perf_counter()
    cuda = profile.cluster.device == "cuda" or (profile.cluster.device == "auto" and torch.cuda.is_available())
    backend = profile.cluster.backend if profile.cluster.backend != "auto" else ("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    dist.init_process_group(backend, timeout=dt.timedelta(seconds=profile.watchdog.pg_timeout_s))
    facts = [None] * dist.get_world_size()
    dist.all_gather_object(facts, rank_facts())
    checks = check_versions(facts)  # type: ignore[arg-type]
    checks.append(check_allreduce(profile, device))
    if dist.get_rank() == 0:
        checks += check_store(profile)
    dist.barrier()
    dist.destroy_process_group()
    return {
        "ok": all(c["status"] != "fail" for c in checks),
        "world_size": len(facts),
        "ranks": facts,
        "checks": checks,
        "duration_s": time.perf_counter() - t_start,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    p = argparse.ArgumentParser(prog="python -m trainer.preflight")
    p.add_argument("--profile", required=True)
    p.add_argument("--out", required=True, help="Local path where rank 0 writes the JSON report.")
    args = p.parse_args(argv)
    profile = load_resolved_profile(args.profile)
    torch.set_num_threads(profile.cluster.threads_per_proc)
    report = run(profile)
    if int(os.environ.get("RANK", 0)) == 0:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
