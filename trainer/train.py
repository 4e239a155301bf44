"""One training attempt on every rank: ``torchrun ... -m trainer --profile resolved.yaml ...``.

Plain torch: no prefect import, so the same command runs under Slurm or
Kubernetes. The loop resumes from the newest valid checkpoint of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import datetime as dt
import json
import logging
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import checkpoint as ckpt
from trainer.beacon import Beacon
from trainer.checkpointer import Checkpointer
from trainer.config import Profile, load_resolved_profile
from trainer.data import TokenStream
from trainer.errors import TrainpipeError
from trainer.faults import Faults
from trainer.model import GPT, model_digest
from trainer.proc import die_with_parent
from trainer.sampler import rank_samples
from trainer.tracking import MetricLogger

log = logging.getLogger("trainpipe.trainer")


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def setup_distributed(profile: Profile) -> Dist:
    cuda = profile.cluster.device == "cuda" or (profile.cluster.device == "auto" and torch.cuda.is_available())
    backend = profile.cluster.backend if profile.cluster.backend != "auto" else ("nccl" if cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # Defaults wait 10-30 min in a stuck collective; the profile bounds it.
    dist.init_process_group(backend, timeout=dt.timedelta(seconds=profile.watchdog.pg_timeout_s))
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def lr_lambda(profile: Profile):
    t = profile.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine

    return factor


def build_optimizer(model: torch.nn.Module, profile: Profile) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": profile.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=profile.train.lr, betas=profile.train.betas)


def get_batch(stream: TokenStream, ids: np.ndarray, block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([stream.window(int(i) * block, block + 1) for i in ids])
    t = torch.from_numpy(rows).to(device)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: TokenStream, profile: Profile, d: Dist) -> float:
    """Mean loss over fixed validation windows spread over the split, shared among ranks."""
    block, mb = profile.model.block_size, profile.train.micro_batch
    n_windows = (len(val) - 1) // block
    total = profile.train.eval_batches * mb * d.world_size
    ids = np.linspace(0, n_windows - 1, num=min(total, n_windows)).astype(np.int64)
    mine = ids[d.rank :: d.world_size]
    model.eval()
    loss_sum = torch.zeros(2, dtype=torch.float64, device=d.device)
    for i in range(0, len(mine), mb):
        x, y = get_batch(val, mine[i : i + mb], block, d.device)
        _, loss = model(x, y)
        loss_sum += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64, device=d.device)
    model.train()
    dist.all_reduce(loss_sum)
    return (loss_sum[0] / loss_sum[1]).item()


def train(args: argparse.Namespace) -> dict[str, Any]:
    profile = load_resolved_profile(args.profile)
    t, c = profile.train, profile.checkpoint
    torch.set_num_threads(profile.cluster.threads_per_proc)
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
    d = setup_distributed(profile)
    seed_everything(t.seed)  # same init on every rank; DDP also broadcasts rank 0's weights

    beacon = Beacon(d.rank)  # first: the supervisor learns this rank's pid before anything slow
    model = GPT(profile.model).to(d.device)
    ddp = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    progress = Progress(beacon)
    ddp.register_comm_hook(progress, _beacon_allreduce_hook)
    optimizer = build_optimizer(model, profile)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(profile))
    train_data = TokenStream(args.dataset_uri, "train", profile.store.storage_options)
    val_data = TokenStream(args.dataset_uri, "val", profile.store.storage_options)
    block, mb, accum = profile.model.block_size, t.micro_batch, profile.grad_accum
    n_samples = (len(train_data) - 1) // block
    ckpt_root = ckpt.checkpoints_uri(profile.store.root, args.run_name)
    so = profile.store.storage_options

    start_step, tokens_seen = 0, 0
    resumed_from, skipped = ckpt.latest_valid(ckpt_root, so)
    for bad in skipped:
        if d.rank == 0:
            log.warning("skipping checkpoint %s: %s", bad.uri, bad.reason)
    if resumed_from is not None:
        model_sd, optim_sd = get_state_dict(ddp, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "progress": {"step": 0, "tokens": 0}}
        ckpt.load_checkpoint(resumed_from.uri, state, so)
        set_state_dict(ddp, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        start_step, tokens_seen = int(state["progress"]["step"]), int(state["progress"]["tokens"])
        extra = ckpt.load_rank_extra(resumed_from.uri, d.rank, so)
        if extra is not None and resumed_from.manifest.get("world_size") == d.world_size:
            set_rng_state(extra["rng"])
        if d.rank == 0:
            log.info("resumed from %s at step %d", resumed_from.uri, start_step)
    elif d.rank == 0:
        log.info("starting from scratch: %d params, world size %d, grad accumulation %d", model.num_params(), d.world_size, accum)

    metrics = MetricLogger(args.tracking_uri if d.rank == 0 else None, args.mlflow_run_id, profile.tracking.flush_every_s)
    faults = Faults(profile.faults, d.rank, attempt=int(os.environ.get("TRAINPIPE_ATTEMPT", "1")))
    trace = SampleTrace(d.rank)
    checkpointer = Checkpointer(
        ckpt_root, c.keep_last, so, use_async=c.async_save, protect=resumed_from.uri if resumed_from else None,
        stale_steps={i.step for i in ckpt.list_checkpoints(ckpt_root, so, verify=False) if i.step > start_step},
        before_commit=faults.before_commit,
        on_commit=lambda step, stall, total: metrics.log({"ckpt/stall_ms": stall * 1000, "ckpt/save_s": total}, step),
    )
    tokens_per_step = t.global_batch * block
    attempt_start = time.time()
    val_loss = float("nan")

    def save(step: int, sync: bool = False) -> None:
        beacon(step, "checkpoint")
        model_sd, optim_sd = get_state_dict(ddp, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "progress": {"step": step, "tokens": tokens_seen}}
        manifest = {
            "step": step,
            "tokens_seen": tokens_seen,
            "data_position": {"next_step": step, "samples_consumed": step * t.global_batch, "seed": t.seed},
            # Hashing waits for the background thread; only the copy of the weights blocks the loop.
            "model_digest": _deferred_digest(model) if d.rank == 0 else None,
            "config_hash": profile.config_hash(),
            "profile": profile.public(),
            "dataset_uri": args.dataset_uri,
            "run_name": args.run_name,
            "val_loss": None if math.isnan(val_loss) else val_loss,
        }
        checkpointer.save(step, state, {"rng": rng_state(), "step": step, "world_size": d.world_size}, manifest, sync=sync)

    step_starts: list[float] = []  # seconds since attempt start: the loop's timeline, for benchmarks
    losses: dict[int, float] = {}  # step -> global mean loss, for the attempt's result
    for step in range(start_step, t.steps):
        done = step + 1
        t0 = time.perf_counter()
        step_starts.append(time.time() - attempt_start)
        progress.begin(done, t0)
        faults.before_step(done)
        ids = rank_samples(step, t.global_batch, t.seed, n_samples, d.rank, d.world_size)
        trace(done, ids)
        loss_acc = torch.zeros((), device=d.device)
        beacon(done, "forward")
        faults.slow_down(done, progress.last_compute_s)
        for micro in range(accum):
            x, y = get_batch(train_data, ids[micro * mb : (micro + 1) * mb], block, d.device)
            last = micro == accum - 1  # DDP all-reduces gradients once, in the last backward
            with ddp.no_sync() if not last else contextlib.nullcontext():
                _, loss = ddp(x, y)
                loss = faults.corrupt_loss(done, loss)
                (loss / accum).backward()
            loss_acc += loss.detach() / accum
        beacon(done, "optimizer")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if not faults.skip_collective(done):
            progress.collective("loss")
            dist.all_reduce(loss_acc)
        step_loss = loss_acc.item() / d.world_size
        tokens_seen += tokens_per_step
        step_ms = (time.perf_counter() - t0) * 1000
        if not math.isfinite(step_loss):
            raise NonFiniteLoss(f"loss is {step_loss} at step {done}; the attempt stops and resumes from the last commit")
        losses[done] = step_loss
        metrics.log(
            {"train/loss": step_loss, "train/lr": lr, "train/grad_norm": float(grad_norm), "perf/step_ms": step_ms,
             "perf/tokens_per_s": tokens_per_step / (step_ms / 1000)},
            done,
        )
        if d.rank == 0 and (done % max(1, t.steps // 20) == 0 or done == t.steps or done == start_step + 1):
            log.info("step %d/%d loss %.4f lr %.2e %.0f ms", done, t.steps, step_loss, lr, step_ms)
        if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
            beacon(done, "eval")
            val_loss = evaluate(ddp, val_data, profile, d)
            metrics.log({"eval/loss": val_loss}, done)
            if d.rank == 0:
                log.info("step %d eval loss %.4f", done, val_loss)
        if done % c.every_steps == 0 or done == t.steps:
            save(done, sync=done == t.steps)  # the final checkpoint is synchronous

    checkpointer.wait()
    if start_step >= t.steps and resumed_from is not None:
        val_loss = float(resumed_from.manifest.get("val_loss") or evaluate(ddp, val_data, profile, d))
    beacon(t.steps, "done")
    metrics.close()
    committed = checkpointer.committed or {
        "step": start_step, "uri": resumed_from.uri if resumed_from else None, "at": attempt_start,
        "digest": resumed_from.manifest.get("model_digest") if resumed_from else None,
    }
    result = {
        "run_name": args.run_name,
        "start_step": start_step,
        "final_step": committed["step"],
        "checkpoint_uri": committed["uri"],
        "model_digest": committed["digest"],
        "val_loss": val_loss,
        "resumed_from": resumed_from.uri if resumed_from else None,
        "skipped_checkpoints": [{"uri": s.uri, "reason": s.reason} for s in skipped],
        "world_size": d.world_size,
        "attempt_s": time.time() - attempt_start,
        "step_s_median": float(np.median(np.diff(step_starts))) if len(step_starts) > 1 else 0.0,
        "checkpoint_failures": checkpointer.failures,
        "checkpoint_stalls_s": checkpointer.stalls_s,
        "tracking_failures": metrics.failures,
        "step_starts_s": step_starts,
        "losses": losses,
    }
    dist.barrier()
    dist.destroy_process_group()
    return result


class Progress:
    """What this rank tells the watchdog: steps, phases, collectives entered, compute time.

    Compute time runs from the step's start to the moment the last gradient
    bucket is ready (DDP calls the comm hook then): everything before that is
    this rank's own work; what follows is waiting for the others.
    """

    def __init__(self, beacon: Beacon):
        self.beacon, self.step, self.t0 = beacon, 0, 0.0
        self.collectives = 0
        self.last_compute_s = 0.0

    def begin(self, step: int, t0: float) -> None:
        self.step, self.t0 = step, t0
        self.beacon(step, "data")

    def collective(self, kind: str, **extra: float) -> None:
        self.collectives += 1
        self.beacon(self.step, "collective", n=self.collectives, c=kind, **extra)

    def gradients_ready(self) -> None:
        self.last_compute_s = time.perf_counter() - self.t0
        self.collective("grads", cs=round(self.last_compute_s, 6))


def _beacon_allreduce_hook(progress, bucket):  # no annotations: DDP checks them against the real classes
    """DDP's plain all-reduce, telling the watchdog when this rank's backward compute is done."""
    if bucket.is_last():
        progress.gradients_ready()
    return default_hooks.allreduce_hook(None, bucket)


def _deferred_digest(model: torch.nn.Module):
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return lambda: model_digest(weights)


class NonFiniteLoss(TrainpipeError):
    """The loss went NaN or inf."""


class SampleTrace:
    """Debug aid: with TRAINPIPE_TRACE_SAMPLES=DIR each rank appends the sample ids of every step to DIR/rank-R.jsonl."""

    def __init__(self, rank: int):
        folder = os.environ.get("TRAINPIPE_TRACE_SAMPLES")
        self._fh = open(os.path.join(folder, f"rank-{rank}.jsonl"), "a") if folder else None  # noqa: SIM115

    def __call__(self, step: int, ids: np.ndarray) -> None:
        if self._fh:
            self._fh.write(json.dumps({"step": step, "ids": [int(i) for i in ids]}) + "\n")
            self._fh.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer", description="Run one training attempt on this rank.")
    p.add_argument("--profile", required=True, help="Path or URI of the resolved profile YAML.")
    p.add_argument("--run-name", required=True)
    p.add_argument("--dataset-uri", required=True)
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--mlflow-run-id", default=None)
    p.add_argument("--result", default=None, help="Local path where rank 0 writes the attempt result JSON.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog asks for stacks before teardown
    rank = os.environ.get("RANK", "0")
    # Under the supervisor every line is already timestamped by the Prefect log.
    stamp = "" if os.environ.get("TRAINPIPE_SUPERVISED") else "%(asctime)s "
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] {stamp}%(levelname)s %(message)s", stream=sys.stdout)
    args = parse_args(argv)
    try:
        result = train(args)
    except TrainpipeError as exc:
        log.error("%s", exc)
        return 3
    if result and rank == "0" and args.result:
        with open(args.result, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0
