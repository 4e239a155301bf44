"""Another local user, for the attacks the threat model gives that role (docs/security.md): a process of uid
``nobody`` on the same machine, run for real with ``subprocess``'s ``user=``/``group=`` (the tests run as root in
CI, which may switch to any uid; elsewhere the test is skipped with that reason)."""

from __future__ import annotations

import os
import subprocess

import pytest

UID = GID = 65534  # nobody, nogroup

PYTHON = "/usr/bin/python3"  # the system's: this checkout's interpreter may lie under a folder only root can enter
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(PYTHON, os.X_OK),
    reason="switching to another uid needs root and the system's python3 (CI runs as root)",
)


def run_as_other_user(code: str, *args: str, timeout: float = 30.0, cwd: str = "/") -> subprocess.CompletedProcess:
    """``python3 -c code`` as uid/gid 65534 with an empty environment (another user has none of ours): the
    standard library only, as an attacker's own script; stdout and stderr as text."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [PYTHON, "-I", "-c", code, *args],
        user=UID,
        group=GID,
        extra_groups=[],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
