"""The grammars of the places a string may reach: a Slurm script, a Kubernetes manifest, a command line, a URL.

A value from a profile, a run form or a record in the store is checked against
the grammar of where it goes before it goes there (docs/security.md). Each
check is a full match (``re.fullmatch``): ``^…$`` with ``re.match`` lets a
trailing newline through, which is exactly the line a job script must never get.
"""

from __future__ import annotations

import re
from typing import Any

# C0, DEL, C1 and the Unicode line and paragraph separators: each can end a line somewhere a value is written.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")

# Slurm partition, account and QOS names (no ',' either: sbatch splits lists on it).
SLURM_NAME = r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}"
# A node: a host name (Slurm's NodeName) or a Kubernetes node's name (a DNS subdomain).
NODE_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})"
DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
DNS_SUBDOMAIN = r"(?=.{1,253}\Z)[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"
# A container image reference as the OCI distribution spec names one: [registry[:port]/]path[:tag][@digest].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REF = (
    rf"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]{{1,5}})?/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?"
)
# A Kubernetes qualified name (resource names such as nvidia.com/gpu, label keys).
QUALIFIED_NAME = rf"(?:{DNS_SUBDOMAIN}/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?"
# A host a process binds to or dials: a name, an IPv4 or IPv6 address.
HOST = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})|[0-9A-Fa-f:.]{2,45}|\[[0-9A-Fa-f:.]{2,45}\]"
# A path written into a Slurm script's #SBATCH lines, which sbatch splits on blanks and expands '%' in.
SCRIPT_PATH = r"/[A-Za-z0-9._/+,:@=-]*"
# An executable named on a node's command line (shlex-quoted there; still nothing a reader would misread).
EXECUTABLE = r"[A-Za-z0-9./_][A-Za-z0-9._/+-]*"  # never '-' first: srun would read it as an option
MLFLOW_RUN_ID = r"[0-9a-f]{32}"
SLURM_JOB_ID = r"[0-9]{1,12}"
LAUNCHER_KIND = r"[a-z][a-z0-9_]{0,31}"  # a launcher's kind: launcher.kind, and its own section launcher.<kind>

# sbatch options a profile may add (``launcher.slurm.sbatch_options``): what to ask of the allocation. Options that
# change what runs, as whom, where its files go or which environment it gets (--wrap, --export, --chdir,
# --output, --uid, --container, …) are left out: trainpipe writes those itself. So are --nodelist (its value
# may name a file sbatch reads; trainpipe places jobs with --exclude) and --mail-user (mail to anyone).
SBATCH_OPTIONS = frozenset(
    [
        "acctg-freq",
        "begin",
        "comment",
        "constraint",
        "core-spec",
        "cores-per-socket",
        "cpu-freq",
        "cpus-per-gpu",
        "deadline",
        "delay-boot",
        "dependency",
        "distribution",
        "exclusive",
        "gpu-bind",
        "gpu-freq",
        "gpus",
        "gpus-per-node",
        "gpus-per-socket",
        "gpus-per-task",
        "gres",
        "gres-flags",
        "hint",
        "kill-on-invalid-dep",
        "licenses",
        "mcs-label",
        "mem",
        "mem-bind",
        "mem-per-cpu",
        "mem-per-gpu",
        "mincpus",
        "network",
        "nice",
        "no-requeue",
        "ntasks-per-core",
        "ntasks-per-gpu",
        "ntasks-per-socket",
        "oversubscribe",
        "power",
        "prefer",
        "priority",
        "profile",
        "qos",
        "requeue",
        "reservation",
        "signal",
        "sockets-per-node",
        "spread-job",
        "switches",
        "thread-spec",
        "threads-per-core",
        "time-min",
        "tmp",
        "tres-per-task",
        "use-min-nodes",
        "wckey",
    ]
)
_SBATCH_OPTION = re.compile(r"--([a-z][a-z-]*)(?:=([A-Za-z0-9_.,:=/+%@&|*()\[\]-]+))?")


def matches(grammar: str, value: str) -> bool:
    return isinstance(value, str) and re.fullmatch(grammar, value) is not None


def sbatch_option_problem(option: str) -> str | None:
    """Why ``option`` may not be a line of a job script, or None when it may."""
    m = _SBATCH_OPTION.fullmatch(option)
    if m is None:
        return f"{option!r} is not one long sbatch option like --gres=gpu:8 (no blanks, quotes or '$')"
    if m.group(1) not in SBATCH_OPTIONS:
        return (
            f"--{m.group(1)} is not an sbatch option a profile may set (trainpipe sets the job's command, "
            "environment and files itself); e.g. --gres, --gpus-per-node, --exclusive, --constraint, --qos, --mem"
        )
    return None


def control_problem(value: Any, where: str = "") -> str | None:
    """Where in a JSON-like ``value`` a control character or a value of no JSON type sits, or None.

    Profiles are YAML: ``!!binary`` or a bare date loads as bytes or a date, which no record can hold."""
    if isinstance(value, str):
        if m := CONTROL.search(value):
            return f"{where or 'a value'} holds the control character {m.group()!r}"
        return None
    if value is None or isinstance(value, bool | int | float):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{where}.{key}" if where else str(key)
            if not isinstance(key, str | int | float | bool):
                return f"{here}: a key must be text"
            if problem := control_problem(str(key), here) or control_problem(item, here):
                return problem
        return None
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if problem := control_problem(item, f"{where}[{i}]"):
                return problem
        return None
    return f"{where or 'a value'} is a {type(value).__name__}, not text, a number, a list or a mapping"


_URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def userinfo(url: str) -> str | None:
    """The user-info of a URL (``user:password`` in ``scheme://user:password@host/…``), whatever characters a
    password holds (a ``/`` or an ``@`` included); None when ``url`` has none.

    An ``@`` is user-info's end when what precedes it has a ``:`` or no ``/`` (``s3://bucket/data@v2`` keeps its
    path); otherwise the authority's own ``@`` (before the first ``/``) is."""
    m = _URL_START.match(url)
    if m is None:
        return None
    rest = url[m.end() :]
    if "@" not in rest:
        return None
    candidate = rest[: rest.rfind("@")]
    if ":" in candidate or "/" not in candidate:
        return candidate
    authority = rest.split("/", 1)[0]
    return authority[: authority.rfind("@")] if "@" in authority else None
