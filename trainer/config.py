"""Run profiles: the schema, one pydantic model per YAML section (docs/architecture.md §2).

Its field descriptions are the run form's and ``--help``'s text. Reading a
profile from its file (``${VAR}``, ``--set`` overrides, precedence), building
one with one-line errors and the same one on fewer nodes is
``trainer/profile_files.py``; the ranks' layout, ``trainer/parallel_dims.py``;
what a run form may set, ``trainer/orchestrate/run_form.py``; a launcher's own
section (``launcher.<kind>``), that launcher's module in ``trainer/launch/``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trainpipe.trainer import grammar
from trainpipe.trainer.parallel_dims import Layout, check_virtual_ranks
from trainpipe.trainer.redact import redact, redact_text, secret_values, url_secrets
from trainpipe.trainer.store_paths import RUN_NAME_PATTERN

BYTE_VOCAB = 256


MAX_RETRY_DELAY_S = 600.0  # the longest wait before a retry (train.retry_delay_s doubles up to it)


class Section(BaseModel):
    # coerce_numbers_to_str: `--set tracking.experiment=2024` parses as YAML (an int) but is meant as a string.
    # allow_inf_nan: an infinite timeout would switch a check off, NaN compares false with every bound.
    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        populate_by_name=True,
        coerce_numbers_to_str=True,
        allow_inf_nan=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _plain_values(cls, value: Any, info: ValidationInfo) -> Any:
        """No control character in any string (a newline would start a new line of a job script), and only
        JSON's types (YAML's ``!!binary`` and bare dates load as bytes and dates, which no record can hold)."""
        field = cls.model_fields[info.field_name] if info.field_name else None
        if field is not None and isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            return value  # a section checks its own fields
        if problem := grammar.control_problem(value):
            raise ValueError(problem.replace("a value", "the value", 1))
        if isinstance(value, dict | list) and _non_finite(value):  # allow_inf_nan stops at a dict[str, Any]
            raise ValueError("the value holds a NaN or an infinity, which no record can hold")
        return value


def _non_finite(value: Any) -> bool:
    """Whether a free-form value (``model.config``, ``store.storage_options``) holds a NaN or an infinity at any
    depth: the model factory would get it while every record said null."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_non_finite(v) for v in value)
    return False


def _grammar(value: str | None, pattern: str, what: str) -> str | None:
    if value is not None and not grammar.matches(pattern, value):
        raise ValueError(f"not {what}")
    return value


def _no_userinfo(value: str) -> str:
    # fsspec chains URLs with '::' (simplecache::http://u:p@host/…): each link of the chain is a URL of its own
    if any(grammar.userinfo(link) is not None for link in value.split("::")):
        raise ValueError(
            "a URL with user-info (user:password@) would put a credential in records and on command lines; "
            "give credentials through the environment (AWS_*, the fsspec backend's own variables)"
        )
    return value


class ClusterConfig(Section):
    nodes: int = Field(1, ge=1, description="Number of nodes (torchrun --nnodes).")
    min_nodes: int = Field(1, ge=1, description="Fewest nodes the run may continue on after exclusions.")
    procs_per_node: int = Field(2, ge=1, le=1024, description="Worker processes per node (torchrun --nproc-per-node).")
    node_rank: int = Field(0, ge=0, description="This node's rank when nodes > 1.")
    master_addr: str = Field("127.0.0.1", description="Rendezvous host.")
    master_port: int = Field(
        0, ge=0, le=65535, description="Rendezvous port (on node 0); 0: a free one on one host, 29500 across hosts."
    )
    local_addr: str | None = Field(
        None,
        description="This node's address the other nodes reach (torchrun --local-addr); None: its host name, "
        "which every node must resolve to it.",
    )
    beacon_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Across hosts: the port of the job watchdog's beacon server on node 0 (master_addr); "
        "0: the rendezvous port + 1.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend; auto is nccl on CUDA, else gloo."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Compute device; auto is cuda when available.")
    threads_per_proc: int = Field(1, ge=1, description="torch intra-op threads per worker (CPU).")
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="One device's peak dense TFLOP/s at the training precision, for perf/mfu; None: known GPUs' "
        "bf16 peak (H100, H200, A100, B200), no MFU elsewhere.",
    )
    simulate_nodes: bool = Field(
        False, description="Run every node's torchrun agent on this machine (tests and drills of multi-node behaviour)."
    )
    isolate: bool | Literal["auto"] = Field(
        "auto",
        description="A single-host job's torchrun agent and ranks in a network namespace of their own, so no other "
        "local user reaches their rendezvous store, process-group store or collectives; auto: wherever the host "
        "allows it and the store is a local folder, on this host's loopback or over https (else one warning); "
        "true: or fail.",
    )
    warm_host: bool = Field(
        True,
        description="Fork each attempt's torchrun agent from a process that keeps torch and the rank programs "
        "imported across the run's attempts, so a retry starts without a cold interpreter; under Slurm and "
        "Kubernetes the run's job (its hosts or pods) is kept across attempts for that.",
    )

    @field_validator("master_addr", "local_addr")
    @classmethod
    def _host(cls, value: str | None) -> str | None:
        return _grammar(value, grammar.HOST, "a host name or an IP address")

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def multi_host(self) -> bool:
        """One torchrun agent per host, each started on its own host (by a launcher or a person)."""
        return self.nodes > 1 and not self.simulate_nodes

    @property
    def rendezvous_port(self) -> int:
        return self.master_port or 29500

    @property
    def watchdog_address(self) -> str:
        """host:port where node 0's job watchdog hears every rank of a multi-host job."""
        return f"{self.master_addr}:{self.beacon_port or self.rendezvous_port + 1}"


class StoreConfig(Section):
    root: str = Field(
        "${TRAINPIPE_HOME}/store",
        description="Object-store URI holding datasets/ and runs/ (local path, file://, s3://).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options (e.g. endpoint_url for S3)."
    )
    retry_s: float = Field(
        120.0,
        ge=0,
        description="How long one store operation is retried through transient errors (refused, reset, 5xx, "
        "throttling) before the attempt fails as retryable.",
    )

    @field_validator("root")
    @classmethod
    def _root(cls, value: str) -> str:
        return _no_userinfo(value)


class DataConfig(Section):
    source: str = Field(
        "stdlib",
        description="'stdlib' (this Python's standard library source), or a glob, folder or fsspec URI of text files, "
        ".jsonl, .parquet, or a folder written by datasets' save_to_disk.",
    )
    text_field: str = Field("text", description="The text's field in JSONL records, column in Parquet and datasets.")
    tokenizer: str = Field(
        "byte",
        min_length=1,
        description="'byte' (one token per UTF-8 byte), 'bpe' (a byte-level BPE of data.vocab_size trained on the "
        "corpus at shard time), or the path/URI of a tokenizer.json.",
    )
    vocab_size: int = Field(4096, ge=257, le=1 << 24, description="Vocabulary size of a trained 'bpe' tokenizer.")
    tokenizer_sample_mb: float = Field(
        100.0,
        gt=0,
        le=1 << 20,
        description="Train-split text (MB) a 'bpe' tokenizer is trained on: a sample of whole pieces, chosen by "
        "their names' hashes, so the same corpus gives the same sample.",
    )
    eot_token: str = Field(
        "<|endoftext|>", min_length=1, description="End-of-text token of a bpe or tokenizer.json tokenizer."
    )
    shard_tokens: int = Field(1 << 20, ge=1024, description="Tokens per shard file.")
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="Share of documents held out for validation.")
    max_bytes: int | None = Field(None, ge=1, description="Stop reading the source after this many bytes (None: all).")
    max_bad_records: int = Field(
        100, ge=0, description="Unreadable records (JSONL lines, rows) skipped, each named, before sharding fails."
    )
    buffer_mb: int = Field(
        1, ge=1, le=4096, description="Text tokenized at once (MB): sharding memory stays near it, whatever the corpus."
    )
    piece_mb: float = Field(
        16.0,
        gt=0,
        le=1 << 20,
        description="Source bytes (MB) per piece: the unit one shard task tokenizes, and of reuse when the corpus "
        "grows. Small files are grouped, large text and JSONL files cut at lines.",
    )
    engine: str = Field(
        "local",
        pattern=r"^(local|(tcp|tls)://[A-Za-z0-9.-]+(:[0-9]{1,5})?)$",
        description="Where the shard tasks run: 'local' (a process pool on this machine) or the address of a "
        "dask.distributed scheduler (tcp://host:8786), whose workers read the source and write the store.",
    )
    engine_connect_s: float = Field(
        10,
        gt=0,
        le=600,
        description="How long the Dask scheduler of data.engine may take to answer before the stage stops and says so.",
    )
    engine_no_worker_s: float = Field(
        30,
        gt=0,
        le=86_400,
        description="How long pieces may wait on a Dask cluster without a worker before the "
        "stage stops and says so (an autoscaled cluster: longer than a worker takes to start).",
    )
    workers: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Processes of the local engine (None: one per core and per 32 MB of text to tokenize, so a "
        "small or mostly unchanged corpus runs in this process; 1: always in this process).",
    )

    @field_validator("source", "tokenizer")
    @classmethod
    def _sources(cls, value: str) -> str:
        return _no_userinfo(value)


GPT_FACTORY = "trainpipe.trainer.model:gpt"
# The built-in factories' names before the folders were installed under the trainpipe namespace: a run, a
# checkpoint or a profile that records one means today's (importing the bare name could import another
# distribution's package).
LEGACY_FACTORIES = {"trainer.model:gpt": GPT_FACTORY, "trainer.hf:causal_lm": "trainpipe.trainer.hf:causal_lm"}


def current_factory(name: Any) -> Any:
    return LEGACY_FACTORIES.get(name, name) if isinstance(name, str) else name


class ModelConfig(Section):
    factory: str = Field(
        GPT_FACTORY,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$",
        description="The model to train: 'package.module:function', a @model_factory given these settings "
        "(trainpipe.trainer.model:gpt, the built-in GPT; trainpipe.trainer.hf:causal_lm, a transformers causal LM "
        "from config).",
    )
    config: dict[str, Any] = Field(
        default_factory=dict, description="Free-form settings for the factory (e.g. a transformers config)."
    )

    @field_validator("factory", mode="before")
    @classmethod
    def _todays_name(cls, value: Any) -> Any:
        return current_factory(value)

    n_layer: int = Field(2, ge=1, description="Transformer blocks (built-in GPT).")
    n_head: int = Field(2, ge=1, description="Attention heads (built-in GPT).")
    n_embd: int = Field(64, ge=8, description="Embedding width (built-in GPT).")
    block_size: int = Field(128, ge=8, description="Context length in tokens: the length of every sample.")
    vocab_size: int = Field(BYTE_VOCAB, ge=2, description="Vocabulary size: the tokenizer's.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability (built-in GPT).")


MAX_STEP = 10**9  # steps and step counts read from records are bounded by this


class TrainConfig(Section):
    run_name: str | None = Field(
        None,
        pattern=RUN_NAME_PATTERN,
        description="Run name (letters, digits, . _ -); the same name resumes the same run. None: generated.",
    )
    steps: int = Field(50, ge=1, description="Optimizer steps in total.")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: every rank holds the whole model; fsdp: FSDP2 shards weights and optimizer state."
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="bf16: the forward pass and the loss under torch.autocast(bfloat16); weights, gradients and "
        "optimizer state stay fp32, so no grad scaler is needed.",
    )
    global_batch: int = Field(16, ge=1, description="Sequences per optimizer step across all ranks.")
    micro_batch: int = Field(4, ge=1, description="Sequences per forward/backward on one rank.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a share of peak (cosine decay).")
    warmup_steps: int = Field(5, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    grad_clip: float = Field(1.0, ge=0, description="Max global grad norm (0: off).")
    seed: int = Field(1337, ge=0, description="Seed for init and data order (non-negative: it seeds numpy's PCG64).")
    eval_every: int = Field(25, ge=0, description="Evaluate every N steps (0: only at the end).")
    eval_batches: int = Field(4, ge=1, description="Micro-batches per rank per evaluation.")
    deterministic: bool = Field(True, description="Use deterministic algorithms (CPU runs are bit-reproducible).")
    virtual_ranks: int | None = Field(
        None,
        ge=1,
        le=1 << 16,
        description="Split each step into this many fixed virtual shards summed in one fixed tree, so the weights "
        "are bit-identical at any world size that divides it (a power of two; DDP and FSDP2). None: off.",
    )
    max_retries: int = Field(2, ge=0, description="Retries of a failed training attempt (each resumes).")
    retry_delay_s: float = Field(
        2.0,
        ge=0,
        le=MAX_RETRY_DELAY_S,
        description="Delay before a retry, doubling with each such failure in a row; none after a crash, hang, "
        "desync, straggler, NaN, loss spike or replica mismatch (a fresh start is the fix).",
    )
    timeout_s: float = Field(3600.0, gt=0, description="Wall-clock limit of one training attempt.")
    rollbacks: list[int] = Field(
        default_factory=list,
        max_length=64,
        description="Steps of loss spikes the run rolls back from (set by the policy, watchdog.on_loss_spike): "
        "resume from the newest checkpoint before each and skip the data from it through the spike.",
    )

    @field_validator("rollbacks")
    @classmethod
    def _positive_steps(cls, value: list[int]) -> list[int]:
        if any(s < 1 or s > MAX_STEP for s in value):
            raise ValueError(f"train.rollbacks holds 1-based steps up to {MAX_STEP}")
        return value


class ParallelConfig(Section):
    dp_replicate: int | None = Field(
        None,
        ge=1,
        le=1 << 16,
        description="Data-parallel replicas (HSDP's replicate dimension under fsdp); None: the ranks left over "
        "under train.strategy ddp, 1 under fsdp.",
    )
    dp_shard: int | None = Field(
        None,
        ge=1,
        le=1 << 16,
        description="Data-parallel ranks FSDP2 shards the weights over; None: the ranks left over under "
        "train.strategy fsdp, 1 under ddp.",
    )
    tp: int = Field(
        1,
        ge=1,
        le=1024,
        description="Tensor-parallel ranks: the model's weight matrices split across them (DTensor, the plan its "
        "factory supplies); keep them on one host.",
    )
    pp: int = Field(
        1,
        ge=1,
        le=1024,
        description="Pipeline stages: the model's layers split across them (torch.distributed.pipelining), "
        "micro-batches of train.micro_batch.",
    )
    pp_schedule: Literal["gpipe", "1f1b"] = Field(
        "1f1b",
        description="Pipeline schedule: gpipe (every forward, then every backward) or 1f1b (one forward, one "
        "backward: activations of at most pp micro-batches held).",
    )
    loss_parallel: bool = Field(
        True,
        description="Under tp, compute the loss on logits sharded over the vocabulary (no gather of the logits) "
        "where the model's plan allows it.",
    )

    def layout(self, world_size: int, strategy: str) -> Layout:
        """The layout over ``world_size`` ranks: a dimension left None takes the ranks left over (ValueError,
        one line, when the sizes cannot be the world size)."""
        rest, fixed = self.tp * self.pp, []
        if world_size % rest:
            raise ValueError(
                f"parallel.tp × parallel.pp = {self.tp} × {self.pp} = {rest} does not divide the world size "
                f"{world_size} (cluster.nodes × cluster.procs_per_node)"
            )
        if strategy == "ddp":
            if (self.tp > 1 or self.pp > 1) or (self.dp_shard or 1) > 1:
                raise ValueError(
                    "train.strategy ddp holds whole replicas only: parallel.tp, parallel.pp and parallel.dp_shard "
                    "need train.strategy fsdp (FSDP2, HSDP with parallel.dp_replicate)"
                )
            fixed = [self.dp_replicate or world_size // rest, 1]
        else:
            replicate = self.dp_replicate or 1
            fixed = [replicate, self.dp_shard or max(1, world_size // (rest * replicate))]
        layout = Layout(self.pp, fixed[0], fixed[1], self.tp, fsdp=strategy == "fsdp")
        if layout.world_size != world_size:
            raise ValueError(
                f"parallel: dp_replicate × dp_shard × tp × pp = {layout.dp_replicate} × {layout.dp_shard} × "
                f"{layout.tp} × {layout.pp} = {layout.world_size}, not the world size {world_size} "
                "(cluster.nodes × cluster.procs_per_node); leave dp_replicate or dp_shard out to fill the rest"
            )
        return layout


class CheckpointConfig(Section):
    every_steps: int | Literal["auto"] = Field(
        25,
        description="Commit a checkpoint every N steps (and at the end); auto: at the Young/Daly interval from "
        "the measured blocking time of a save and mtbf_hours.",
    )
    mtbf_hours: float = Field(
        24.0,
        gt=0,
        le=1_000_000,
        description="Expected hours between failures of the job, for every_steps: auto (a run with failures on "
        "record uses its own history instead).",
    )

    @field_validator("every_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: Any) -> Any:
        if value == "auto":
            return value
        steps = value if isinstance(value, int) and not isinstance(value, bool) else None
        if isinstance(value, str) and value.strip().isdigit():
            steps = int(value)
        if steps is None or steps < 1:
            raise ValueError("a number of steps (1 or more) or auto")
        return steps

    memory_every_steps: int | Literal["auto", "off"] = Field(
        "off",
        description="Also snapshot every rank's state into this host's memory (a private folder in /dev/shm kept "
        "for the run's attempts, at most 2 snapshots) every N steps; a retry resumes from the newest snapshot "
        "that verifies before the store's checkpoints. auto: at the Young/Daly interval from the snapshot's "
        "measured blocking time and mtbf_hours; off: the store alone. Single-host runs of the local launcher.",
    )

    memory_snapshot: Literal["flash", "dcp"] = Field(
        "flash",
        description="How a snapshot is written into host memory. flash: each rank's tensors copied into two "
        "shared-memory slots with an XXH3-64 checksum each, a tenth of dcp's CPU or less, copied to a peer host across "
        "hosts; DDP or one rank (a sharded state gets dcp, said once). dcp: the store's save path (DCP files, "
        "their sha256, the state hash), on one host or copied to a peer host.",
    )

    @field_validator("memory_every_steps", mode="before")
    @classmethod
    def _steps_auto_or_off(cls, value: Any) -> Any:
        if value == "off":
            return value
        try:
            return cls._steps_or_auto(value)
        except ValueError:
            raise ValueError("a number of steps (1 or more), auto or off") from None

    keep_last: int = Field(3, ge=1, description="Committed checkpoints kept per run.")
    async_save: bool = Field(
        True, alias="async", description="DCP async save: block only while staging; commit when the write ends."
    )
    verify_state: bool = Field(
        True,
        description="A resume hashes the state it loaded and refuses a checkpoint whose hash is not the one "
        "recorded at its save. false: resume unverified with a warning (e.g. after an upgrade changed the "
        "layout of the optimizer's or scheduler's state).",
    )


class TrackingConfig(Section):
    enabled: bool = Field(True, description="Log to MLflow.")
    tracking_uri: str = Field("sqlite:///${TRAINPIPE_HOME}/mlflow.db", description="MLflow tracking URI.")
    experiment: str = Field("trainpipe", description="MLflow experiment name.")
    flush_every_s: float = Field(2.0, gt=0, description="Rank 0 sends buffered metrics this often.")
    system_metrics: bool = Field(
        True, description="Log CPU, memory, disk, network (and GPU) use of each training host as system/{node}/*."
    )
    system_metrics_every_s: float = Field(
        5.0, ge=0.5, le=600, description="Sample the system metrics this often (a minute's run draws a curve)."
    )


class WatchdogConfig(Section):
    enabled: bool = Field(
        True, description="Watch the ranks' progress beacons for hangs, desyncs, crashes and stragglers."
    )
    hang_timeout_s: float | None = Field(
        None,
        gt=0,
        description="No progress for this long is a hang; "
        "None: adaptive, max(hang_floor_s, hang_factor × median step time).",
    )
    hang_floor_s: float = Field(10.0, gt=0, description="Adaptive hang allowance: never less than this.")
    hang_factor: float = Field(20.0, gt=1, description="Adaptive hang allowance: this many median step times.")
    startup_timeout_s: float = Field(
        300.0, gt=0, description="Allowance before every rank reached its first step (imports, rendezvous, resume)."
    )
    slow_phase_timeout_s: float = Field(180.0, gt=0, description="Allowance while a rank checkpoints or evaluates.")
    exit_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Allowance for the end of an attempt after the final commit (metrics flush, barrier, teardown); "
        "past it the job is stopped and the attempt still counts.",
    )
    stopped_after_s: float = Field(
        1.0,
        gt=0,
        description="A rank whose process is stopped (SIGSTOP, a debugger holding it) while no rank advanced for "
        "this long plus three median steps is a hang, without waiting out the hang allowance.",
    )
    poll_s: float = Field(0.5, gt=0, le=10, description="How often the watchdog looks.")
    pg_timeout_s: float = Field(
        300.0, gt=0, description="torch.distributed collective timeout (the backstop under the watchdog)."
    )
    straggler_window: int = Field(10, ge=2, description="Steps per straggler window.")
    straggler_factor: float = Field(
        1.3, gt=1, description="A rank computing this many times the median is slow in a window."
    )
    straggler_patience: int = Field(2, ge=1, description="Consecutive slow windows before a rank is flagged.")
    on_straggler: Literal["warn", "abort", "exclude"] = Field(
        "warn",
        description="warn: log an incident; abort: fail the attempt (retry); "
        "exclude: relaunch on fewer nodes when cluster.min_nodes allows.",
    )
    stack_dump_s: float = Field(
        1.0, ge=0, description="Seconds given to live ranks to print their Python stacks before teardown."
    )
    # The quiet faults (docs/architecture.md §9): read from the same beacons, decided by trainer.supervise.watchdog.
    health_window: int = Field(
        50,
        ge=2,
        le=10_000,
        description="Steps in the rolling median that a loss or gradient-norm spike is measured against.",
    )
    loss_spike_factor: float = Field(
        2.0, gt=1, le=1e6, description="A training loss above this many times its rolling median is a loss spike."
    )
    grad_spike_factor: float = Field(
        10.0, gt=1, le=1e6, description="A gradient norm above this many times its rolling median is a loss spike."
    )
    on_loss_spike: Literal["warn", "rollback", "stop"] = Field(
        "rollback",
        description="warn: log an incident; rollback: resume from the newest checkpoint before the spike and skip "
        "the data that fed it (the skip is recorded); stop: end the run.",
    )
    flatline_steps: int = Field(
        500,
        ge=3,
        le=10_000,
        description="The training loss's trend over this many steps not falling beyond its own noise is a flatline.",
    )
    on_flatline: Literal["warn", "stop"] = Field("warn", description="warn: log an incident; stop: end the run.")
    sdc_every: int | None = Field(
        50,
        ge=1,
        description="DDP replicas compare a checksum of their weights' exact bits every N steps and before every "
        "checkpoint commit (None: off). A mismatch is an sdc incident; the run rolls back to the newest checkpoint.",
    )
    replay: bool = Field(
        True,
        description="After a resume, train the step after the checkpoint again and compare its loss with the one "
        "recorded when the checkpoint was saved (a difference is an sdc incident).",
    )
    network_factor: float = Field(
        3.0,
        gt=1,
        le=1e6,
        description="Collective wait above this many times its own baseline (while compute stays flat), for "
        "straggler_patience windows, is a network incident.",
    )
    data_stall_share: float = Field(
        0.4, gt=0, lt=1, description="A rank waiting for data this share of its step time is a data stall."
    )
    on_network: Literal["warn", "abort"] = Field(
        "warn", description="warn: log an incident; abort: fail the attempt (the retry measures the links first)."
    )
    on_data_stall: Literal["warn", "abort"] = Field("warn", description="warn: log an incident; abort: fail it.")
    gpu_idle_pct: float = Field(
        10.0,
        ge=0,
        le=100,
        description="GPUs busy under this share (NVML utilization, %) while steps take straggler_factor times "
        "their first 20 steps' are a gpu_idle warning.",
    )
    probe_links: bool = Field(
        False,
        description="Before the first step, time each link of the host ring (per local rank) and fail the attempt "
        "naming a host whose links are slow, or a slow link; the retry after a network incident sets it. Not from a "
        "run form: its verdict excludes nodes.",
    )


class PreflightConfig(Section):
    enabled: bool = Field(True, description="Run the preflight stage before training.")
    allreduce_mb: float = Field(4.0, gt=0, le=4096, description="Payload of the all-reduce timing test.")
    max_allreduce_ms: float | None = Field(None, gt=0, description="Fail when the all-reduce round trip is slower.")
    store_probe_mb: float = Field(1.0, gt=0, le=1024, description="Bytes written and read back in the store check.")
    min_free_disk_gb: float = Field(1.0, ge=0, description="Fail when a local store has less free disk.")
    timeout_s: float = Field(120.0, gt=0, description="Wall-clock limit of the preflight job.")
    gpu_temp_margin_c: float = Field(
        5.0, ge=0, description="GPU temperature: warn this many °C below slowdown, fail this close to shutdown."
    )
    min_sm_clock_ratio: float = Field(
        0.5, ge=0, le=1, description="GPU clocks: flag an SM clock below this share of its max (fail while throttled)."
    )
    max_power_ratio: float = Field(
        0.98, gt=0, le=1, description="GPU power: warn when the draw exceeds this share of the enforced limit."
    )
    pcie_degraded: Literal["warn", "fail"] = Field(
        "warn", description="GPU PCIe link below its max gen or width: warn or fail."
    )
    max_compute_slowdown: float = Field(
        0.25,
        gt=0,
        description="Compute check: fail a rank slower than the median of the other ranks by more than this share.",
    )
    gemm_n: int | None = Field(
        None, ge=64, le=16384, description="Compute check matrix size; None: 4096 on GPU, 384 on CPU."
    )
    min_busbw_gbps: float | None = Field(
        None, gt=0, description="Fail when all-reduce bus bandwidth at the largest size is lower."
    )
    pairwise: bool = Field(
        True, description="Time each rank's link to its ring neighbour to localise a slow link or node."
    )
    min_shm_gb: float = Field(1.0, ge=0, description="Warn when /dev/shm is smaller (NCCL and data loaders use it).")
    consistency_fail: list[str] = Field(
        default_factory=lambda: ["python", "torch", "cuda", "nccl", "trainpipe", "driver"],
        description="Facts that must be equal on every node (others only warn when they differ).",
    )
    on_fail: Literal["stop", "exclude"] = Field(
        "stop", description="stop: end before training; exclude: drop failing nodes if cluster.min_nodes still holds."
    )


class FaultsConfig(Section):
    """Fault drills: inject one fault on purpose, to rehearse detection and recovery."""

    kind: Literal[
        "none",
        "crash",
        "exception",
        "hang",
        "slow",
        "nan",
        "extra_collective",
        "slow_checkpoint",
        "crash_in_checkpoint",
        "slow_exit",
        "loss_spike",
        "bitflip",
        "slow_network",
        "slow_data",
    ] = Field(
        "none",
        description="What to inject: crash (exit/kill), exception, hang (alive and idle in the step's forward), "
        "slow, nan loss, extra_collective (one rank calls a collective the others do not), slow_checkpoint "
        "(delay before commit), crash_in_checkpoint (die between write and commit), slow_exit (hold the end of "
        "the attempt), loss_spike (scale the loss by factor once), bitflip (flip one bit of one weight once), "
        "slow_network (hold each gradient all-reduce step_delay_s), slow_data (hold each batch read step_delay_s).",
    )
    rank: int = Field(0, ge=0, description="Global rank that misbehaves.")
    step: int = Field(1, ge=1, description="Optimizer step (1-based) at which the fault starts.")
    attempts: int = Field(
        1, ge=0, description="Inject only in the first N attempts (0: every attempt), so a retry can succeed."
    )
    exit_code: int | None = Field(None, description="crash: exit with this code; None sends SIGKILL to itself.")
    factor: float = Field(
        3.0, ge=1.0, le=1e6, description="slow: multiply this rank's compute time; loss_spike: its loss, once."
    )
    step_delay_s: float = Field(
        0.2, ge=0.0, le=60.0, description="slow_network, slow_data: seconds added to each step from faults.step on."
    )
    bit: int = Field(16, ge=0, le=31, description="bitflip: the bit of a float32 weight to flip (23-30: exponent).")
    delay_s: float = Field(
        5.0,
        ge=0.0,
        description="slow_checkpoint: seconds between the write and the commit; slow_exit: seconds held after it.",
    )


class CostConfig(Section):
    gpu_hour_usd: float | None = Field(None, ge=0, description="Price of one GPU hour, to cost wasted time.")


class PublishConfig(Section):
    """The publish stage (docs/architecture.md §11): the validated checkpoint as a Hugging Face folder, logged to
    the MLflow run as a transformers model and registered; the operator's (not a run form's) to set."""

    enabled: bool = Field(True, description="After validate, export, log and register the model.")
    registered_model: str | None = Field(
        None,
        pattern=r"^[^\x00-\x1f\x7f'\"`\\]{1,256}$",
        description="Registered model name in MLflow's Model Registry; None: the experiment's name "
        "(tracking.experiment).",
    )
    gate_tolerance: float = Field(
        0.0,
        ge=0,
        le=100,
        allow_inf_nan=False,
        description="'champion' moves to the new version when its val loss is at most the champion's plus this "
        "(both recomputed by the publish stage on the same data and tokenizer).",
    )
    gate_max_val_loss: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Or when its val loss is at most this, whatever the champion's (the profile's own threshold).",
    )
    prompt: str = Field(
        "def ", min_length=1, max_length=200, description="The logged model's input example: a prompt it completes."
    )

    def name_for(self, experiment: str) -> str:
        return self.registered_model or experiment


class DeployConfig(Section):
    """How `trainpipe serve` deploys this profile to Prefect."""

    nightly_cron: str = Field("0 2 * * *", description="Cron schedule of the 'nightly' deployment.")
    timezone: str = Field("UTC", description="Time zone of the cron schedule (IANA name).")
    overridable: list[str] = Field(
        default_factory=lambda: ["default"],
        description="Keys a deployment's run form may override beyond its typed fields (section.key, section.key.item, "
        "section.* for a whole section, 'default' for trainpipe's list). Keep store.*, data.source, data.tokenizer, "
        "model.factory, model.config, launcher.*, tracking.* and deploy.* out unless every run-form user may set them.",
    )
    path_roots: list[str] = Field(
        default_factory=list,
        description="Folders or URI prefixes under which a run form may name a path (data.source, data.tokenizer, "
        "store.root, launcher.shared_dir) when overridable lets it; empty: it may name none.",
    )

    @field_validator("overridable")
    @classmethod
    def _keys(cls, value: list[str]) -> list[str]:
        for key in value:
            if key != "default" and not re.fullmatch(r"[a-z_]+\.([a-z_]+(\.[a-z0-9_]+)?|\*)", key):
                raise ValueError(f"{key!r} is not section.key, section.key.item, section.* or default")
        return value

    @field_validator("nightly_cron")
    @classmethod
    def _five_fields(cls, value: str) -> str:
        if len(value.split()) != 5:
            raise ValueError(f"expected a 5-field cron expression like '0 2 * * *', got {value!r}")
        return value


class LauncherConfig(Section):
    """Who starts each host's part of a training attempt, and how the train task follows it. What a launcher needs
    of its own is its section, ``launcher.<kind>``, whose model its module defines (trainer/launch/; checked when
    the run is resolved and whenever the launcher reads it: ``trainer.launcher.check_launcher``)."""

    model_config = ConfigDict(extra="allow")  # launcher.<kind>: each launcher's own section

    kind: str = Field(
        "local",
        description="The launcher that starts each host's part: local (this machine's supervisor, simulated nodes "
        "included), or another registered in trainer/launch/ (its module says what it starts and its options).",
    )
    shared_dir: str = Field(
        "${TRAINPIPE_HOME}/jobs",
        description="Folder every node and the orchestrator see (a shared file system): job scripts, the resolved "
        "profile, each host's outcome and the job's output.",
    )
    python: str | None = Field(
        None, description="The Python on the nodes that has trainpipe installed (None: this one's path, or python)."
    )
    poll_s: float = Field(1.0, gt=0, le=60, description="How often the train task looks at the job.")
    excluded_nodes: list[str] = Field(
        default_factory=list,
        description="Nodes the cluster launchers keep the job off (sbatch --exclude; a Kubernetes node affinity). "
        "A run's exclusions (a straggler, a node that failed twice, preflight) are added here.",
    )

    # Each value below reaches a job script's #SBATCH line, an sbatch or srun argument, or a Kubernetes manifest:
    # checked against that place's grammar (trainer/grammar.py), so it cannot start a line or an option of its own.
    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        _grammar(value, grammar.LAUNCHER_KIND, "a launcher's name (lower-case letters, digits and _)")
        return value

    @field_validator("excluded_nodes")
    @classmethod
    def _node_names(cls, value: list[str]) -> list[str]:
        for node in value:
            _grammar(node, grammar.NODE_NAME, "a node's name (letters, digits, '.', '_', '-')")
        return value

    @field_validator("python")
    @classmethod
    def _python(cls, value: str | None) -> str | None:
        return _grammar(value, grammar.EXECUTABLE, "a path to a Python executable (no blanks or quotes)")

    @model_validator(mode="after")
    def _sections_are_mappings(self) -> LauncherConfig:
        """Each key besides the common ones is a launcher's section: a mapping of plain values, which that
        launcher's options model checks (here only what every value must be)."""
        for key, value in (self.__pydantic_extra__ or {}).items():
            if not grammar.matches(grammar.LAUNCHER_KIND, key) or not isinstance(value, dict):
                shown = key[:40] if grammar.control_problem(key) is None else repr(key[:40])  # one line stays one
                raise ValueError(
                    f"launcher.{shown}: not a key of launcher ({', '.join(type(self).model_fields)}); a "
                    "launcher's own options go in its section, launcher.<kind>.<option> (e.g. launcher.slurm.partition)"
                )
            if problem := grammar.control_problem(value, f"launcher.{key}"):
                raise ValueError(problem)
            if _non_finite(value):
                raise ValueError(f"launcher.{key} holds a NaN or an infinity, which no record can hold")
        return self

    def sections(self) -> list[str]:
        """The launchers' sections this profile has (``launcher.<kind>``)."""
        return list(self.__pydantic_extra__ or {})

    def section(self, kind: str) -> dict[str, Any]:
        """``launcher.<kind>`` as written (empty when absent): its launcher's options model checks it."""
        return dict((self.__pydantic_extra__ or {}).get(kind) or {})


_S = TypeVar("_S", bound=Section)


def _section(cls: type[_S]) -> Any:
    """A section field whose default is the section at its own defaults. Type checkers read ``Field(1, …)`` as
    no default, so ``cls()`` would look like a call missing every argument; ``model_validate({})`` is the same."""
    return Field(default_factory=lambda: cls.model_validate({}))


class Profile(Section):
    name: str = Field("custom", description="Profile name.")
    cluster: ClusterConfig = _section(ClusterConfig)
    store: StoreConfig = _section(StoreConfig)
    data: DataConfig = _section(DataConfig)
    model: ModelConfig = _section(ModelConfig)
    train: TrainConfig = _section(TrainConfig)
    parallel: ParallelConfig = _section(ParallelConfig)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)
    tracking: TrackingConfig = _section(TrackingConfig)
    watchdog: WatchdogConfig = _section(WatchdogConfig)
    preflight: PreflightConfig = _section(PreflightConfig)
    faults: FaultsConfig = _section(FaultsConfig)
    cost: CostConfig = _section(CostConfig)
    publish: PublishConfig = _section(PublishConfig)
    deploy: DeployConfig = _section(DeployConfig)
    launcher: LauncherConfig = _section(LauncherConfig)

    _secrets: frozenset[str] = PrivateAttr(default_factory=frozenset)

    @model_validator(mode="after")
    def _check_combinations(self) -> Profile:
        t, c, m = self.train, self.cluster, self.model
        layout = self.parallel.layout(c.world_size, t.strategy)
        per_step = t.micro_batch * layout.dp
        if t.global_batch % per_step:
            ranks = (
                f"world size = {t.micro_batch} × {c.world_size}"
                if layout.dp == c.world_size
                else (f"data-parallel ranks = {t.micro_batch} × {layout.dp} ({layout.describe()})")
            )
            raise ValueError(
                f"train.global_batch={t.global_batch} is not divisible by train.micro_batch × {ranks}; "
                f"pick a multiple of {per_step}"
            )
        if layout.pp > 1 and self.parallel.pp_schedule == "1f1b" and t.global_batch // per_step < layout.pp:
            raise ValueError(
                f"parallel.pp_schedule 1f1b needs at least as many micro-batches per step as stages: "
                f"train.global_batch / (train.micro_batch × {layout.dp} data-parallel ranks) = "
                f"{t.global_batch // per_step} < parallel.pp={layout.pp}; raise train.global_batch or use gpipe"
            )
        if t.virtual_ranks is not None:
            if layout.meshed:
                raise ValueError(
                    f"train.virtual_ranks works over one data-parallel dimension, not the layout {layout.describe()}"
                )
            check_virtual_ranks(t.virtual_ranks, t.deterministic, t.global_batch, t.micro_batch, c.world_size)
        if c.nodes < c.min_nodes:
            raise ValueError(f"cluster.nodes={c.nodes} is below cluster.min_nodes={c.min_nodes}")
        if m.factory == GPT_FACTORY and m.n_embd % m.n_head:
            raise ValueError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}")
        if m.factory == GPT_FACTORY and (m.n_head % layout.tp or m.n_embd % layout.tp):
            what = "model.n_head" if m.n_head % layout.tp else "model.n_embd"
            raise ValueError(f"parallel.tp={layout.tp} does not divide {what}={getattr(m, what.split('.')[1])}")
        if layout.tp > 1 and c.procs_per_node % layout.tp:
            raise ValueError(
                f"parallel.tp={layout.tp} does not divide cluster.procs_per_node={c.procs_per_node}: a "
                "tensor-parallel group's ranks exchange every layer's activations and must sit on one host"
            )
        if m.factory == GPT_FACTORY and layout.tp > 1 and m.dropout > 0:
            raise ValueError(
                f"model.dropout={m.dropout} with parallel.tp={layout.tp}: the tensor-parallel ranks would draw the "
                "same dropout masks for different heads; set model.dropout: 0 or parallel.tp: 1"
            )
        if m.factory == GPT_FACTORY and layout.pp > m.n_layer:
            raise ValueError(
                f"parallel.pp={layout.pp} is more than model.n_layer={m.n_layer}: each pipeline stage needs a layer"
            )
        if self.data.tokenizer == "byte" and m.vocab_size < BYTE_VOCAB:
            raise ValueError(f"model.vocab_size={m.vocab_size} is below the byte tokenizer's {BYTE_VOCAB}")
        if self.data.tokenizer == "bpe" and m.vocab_size < self.data.vocab_size:
            raise ValueError(
                f"model.vocab_size={m.vocab_size} is below data.vocab_size={self.data.vocab_size} of the bpe "
                f"tokenizer; set model.vocab_size: {self.data.vocab_size}"
            )
        return self

    @property
    def layout(self) -> Layout:
        """The ranks' layout (``parallel``) over this profile's world size."""
        return self.parallel.layout(self.cluster.world_size, self.train.strategy)

    @property
    def grad_accum(self) -> int:
        """Micro-batches per step on a data-parallel rank (under pp: the pipeline's micro-batches)."""
        return self.train.global_batch // (self.train.micro_batch * self.layout.dp)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def public(self) -> dict[str, Any]:
        """The profile as a dict without credentials (``trainer.redact``): safe to log and store."""
        body = self.model_dump(mode="json")
        options = redact(body["store"].pop("storage_options"), self._secrets, by_key=True)
        body = redact(body, self._secrets)
        body["store"]["storage_options"] = options
        return body

    def with_secrets(self, secrets: set[str] | frozenset[str]) -> Profile:
        """Remember values to hide wherever they appear: those expanded from credential-named variables, under
        credential-named store options, and the password of the tracking URI (as written and percent-decoded)."""
        found = secret_values(self.store.storage_options) | url_secrets(self.tracking.tracking_uri)
        self._secrets = frozenset(self._secrets | secrets | found)
        return self

    def private_env(self) -> dict[str, str]:
        """What a job's processes need beyond the public profile file they read: the store settings and the
        values to redact, through the environment (never a file or a command line)."""
        body = {"store": self.store.model_dump(mode="json"), "secrets": sorted(self._secrets)}
        return {PRIVATE_ENV: json.dumps(body)}

    def public_yaml(self) -> str:
        return yaml.safe_dump(self.public(), sort_keys=False)

    def hide(self, text: object) -> str:
        """``text`` (an exception's, say: an MLflow client quotes the URL it called) as it may be logged: without
        URL user-info or any value this profile hides."""
        return redact_text(str(text), self._secrets)

    def flat(self) -> dict[str, Any]:
        """``section.key -> value`` for MLflow params (credentials redacted)."""
        out: dict[str, Any] = {"name": self.name}
        for section, values in self.public().items():
            if isinstance(values, dict):
                for key, value in values.items():
                    out[f"{section}.{key}"] = value
        return out

    def config_hash(self) -> str:
        """Hash of what determines the training trajectory (not where it is stored or tracked)."""
        body = self.model_dump(mode="json", include={"data", "model", "train"})
        operational = ("run_name", "max_retries", "retry_delay_s", "timeout_s", "eval_every", "eval_batches")
        for key in (*operational, "rollbacks"):  # a rollback's skips are in the checkpoints' manifests
            body["train"].pop(key)
        blob = json.dumps(body, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


PRIVATE_ENV = "TRAINPIPE_PRIVATE_PROFILE"
