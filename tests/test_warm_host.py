"""The warm host: a run's attempts fork their torchrun agent from one process that keeps torch imported
(trainer/supervise/warm_host.py). Real torchrun jobs on the tiny profile."""

from __future__ import annotations

import os
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.supervise.attempt import train_attempt
from trainpipe.trainer.supervise.warm_host import keep_warm

pytestmark = pytest.mark.distributed

SECRET = "warm-host-secret-7f3a"
WATCHED = ("tracking.enabled=false", "preflight.enabled=false", "watchdog.poll_s=0.1")  # Lineage looks often


def signals(pid: int) -> tuple[str, str]:
    """The signals a process ignores and catches, as the kernel shows them."""
    text = Path(f"/proc/{pid}/status").read_text()
    status = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
    return status["SigIgn"].strip(), status["SigCgt"].strip()


class Lineage:
    """At each watchdog poll: the rank processes' parent (the agent) and grandparent (a warm host, if any), and
    what signals a rank and its agent ignore and catch."""

    def __init__(self) -> None:
        self.agents: set[tuple[int, str]] = set()
        self.hosts: set[tuple[int, str]] = set()
        self.signals: set[tuple[str, tuple[str, str]]] = set()
        self.lock = threading.Lock()

    def __call__(self, progress: dict[int, dict]) -> None:
        for p in progress.values():
            try:
                rank = psutil.Process(p["pid"])
                agent = rank.parent()
                host = agent.parent()
                with self.lock:
                    self.agents.add((agent.pid, agent.name()))
                    self.hosts.add((host.pid, host.name()))
                    self.signals |= {("rank", signals(rank.pid)), ("agent", signals(agent.pid))}
            except (KeyError, TypeError, psutil.Error, AttributeError, OSError):
                continue


def test_the_attempts_of_a_scope_fork_from_one_warm_host_and_train_the_same_bits(home, tiny_profile):
    """Cold, then twice warm: the same final weights; both warm agents are children of one `trainpipe-warm`
    process, which holds no credential of the job's environment and is gone when the scope ends; a warm agent
    and its ranks ignore and catch the signals a cold start's do (a reset socket is an error, not SIGPIPE)."""
    prof = tiny_profile(*WATCHED)
    uri = shard_dataset(prof.data, prof.store).uri
    env = {"AWS_SECRET_ACCESS_KEY": SECRET, "HF_TOKEN": SECRET}
    started_cold = Lineage()
    cold = train_attempt(prof, "cold", uri, env=env, on_progress=started_cold)
    assert cold.result is not None, "\n".join(cold.job.tail)
    assert "warm" not in cold.job.job  # outside a scope every attempt starts cold
    lineages = [Lineage(), Lineage()]
    with keep_warm():
        warm = [train_attempt(prof, f"warm{n}", uri, env=env, on_progress=lineages[n]) for n in range(2)]
        [host_pid] = {pid for line in lineages for pid, name in line.hosts}
        host = psutil.Process(host_pid)
        host_env = host.environ()
        assert host.name() == "trainpipe-warm" and host.ppid() == os.getpid()
    for out in warm:
        assert out.result is not None, "\n".join(out.job.tail)
        assert out.job.job.endswith(", forked by a warm host")
        assert out.result.model_digest == cold.result.model_digest
    assert lineages[0].agents.isdisjoint(lineages[1].agents)  # a fresh agent per attempt
    assert {name for line in lineages for _, name in line.agents} == {"trainpipe-agent"}
    assert started_cold.signals and lineages[0].signals == lineages[1].signals == started_cold.signals
    assert not any(SECRET in v for v in host_env.values()) and host_env.get("OMP_NUM_THREADS") == "1"
    assert not psutil.pid_exists(host_pid) or psutil.Process(host_pid).status() == psutil.STATUS_ZOMBIE


def test_a_changed_model_module_replaces_the_warm_host(home, tiny_profile, tmp_path, monkeypatch):
    """A warm host imported the model factory's module; once that file changes on disk, the next attempt runs
    the new code from a new warm host, not the stale copy in memory."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    module = plugins / "warm_model.py"

    def write(generation: int) -> None:
        module.write_text(
            textwrap.dedent(f"""
                from trainpipe.trainer.factory import model_factory
                from trainpipe.trainer.model import GPT

                @model_factory
                def gpt(cfg):
                    print("model generation {generation}", flush=True)
                    return GPT(cfg)
            """)
        )
        past = time.time_ns() - (10 - generation) * 1_000_000_000  # distinct, and before any warm host started
        os.utime(module, ns=(past, past))

    write(1)
    monkeypatch.setenv("PYTHONPATH", str(plugins))
    monkeypatch.syspath_prepend(str(plugins))
    prof = tiny_profile(*WATCHED, "model.factory=warm_model:gpt")
    uri = shard_dataset(prof.data, prof.store).uri
    lineages = [Lineage(), Lineage()]
    with keep_warm():
        first = train_attempt(prof, "first", uri, on_progress=lineages[0])
        write(2)
        second = train_attempt(prof, "second", uri, on_progress=lineages[1])
    assert first.result is not None and second.result is not None, "\n".join(second.job.tail)
    assert any("model generation 1" in line for line in first.job.tail)
    assert any("model generation 2" in line for line in second.job.tail)
    assert not any("model generation 1" in line for line in second.job.tail)
    assert second.job.job.endswith(", forked by a warm host")
    [(old, _)], [(new, _)] = lineages[0].hosts, lineages[1].hosts
    assert old != new


def test_a_warm_host_that_died_between_attempts_is_replaced(home, tiny_profile):
    prof = tiny_profile(*WATCHED)
    uri = shard_dataset(prof.data, prof.store).uri
    lineages = [Lineage(), Lineage()]
    with keep_warm():
        first = train_attempt(prof, "first", uri, on_progress=lineages[0])
        [(host, _)] = lineages[0].hosts
        psutil.Process(host).kill()  # the OOM killer, say
        psutil.Process(host).wait(10)
        second = train_attempt(prof, "second", uri, on_progress=lineages[1])
    assert first.result is not None and second.result is not None, "\n".join(second.job.tail)
    assert second.job.job.endswith(", forked by a warm host")
    [(again, name)] = lineages[1].hosts
    assert again != host and name == "trainpipe-warm"


def test_a_warm_host_killed_during_an_attempt_ends_it_with_nothing_left_behind(home, tiny_profile):
    """The agent and the ranks die with their warm host; the attempt ends as a failure, not a hang (the
    no_leftover_processes fixture checks that nothing survives)."""
    prof = tiny_profile(*WATCHED, "train.steps=400")
    uri = shard_dataset(prof.data, prof.store).uri
    killed: list[int] = []

    def kill_the_host(progress: dict[int, dict]) -> None:
        if killed or not progress or min(p.get("step", -1) for p in progress.values()) < 3:
            return
        for p in progress.values():
            host = psutil.Process(p["pid"]).parent().parent()
            assert host.name() == "trainpipe-warm"
            killed.append(host.pid)
            host.kill()
            return

    with keep_warm():
        out = train_attempt(prof, "orphaned", uri, on_progress=kill_the_host)
    assert killed and out.result is None and out.incident is not None
    assert out.job.wall_s < 60


def test_an_environment_too_large_for_one_message_starts_cold_and_keeps_the_warm_host(home, tiny_profile):
    prof = tiny_profile(*WATCHED)
    uri = shard_dataset(prof.data, prof.store).uri
    large = {f"TRAINPIPE_TEST_BULK_{i}": "x" * 90_000 for i in range(3)}  # each under execve's 128 KiB a string
    lineages = [Lineage(), Lineage()]
    with keep_warm():
        first = train_attempt(prof, "first", uri, on_progress=lineages[0])
        bulky = train_attempt(prof, "bulky", uri, env=large)
        again = train_attempt(prof, "again", uri, on_progress=lineages[1])
    assert first.result and bulky.result and again.result, "\n".join(bulky.job.tail)
    assert "warm" not in bulky.job.job and again.job.job.endswith(", forked by a warm host")
    assert lineages[0].hosts == lineages[1].hosts  # the warm host stayed
