"""A multi-host attempt from its hosts' parts (``job_outcome``), and what a host needs before it starts."""

from __future__ import annotations

import json

import pytest

from tests.conftest import train_result
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.incidents import Incident
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.supervise.attempt import run_module
from trainpipe.trainer.supervise.host import job_outcome
from trainpipe.trainer.supervise.launch import torchrun_command


def part(node: str, incident: Incident | None = None, rank: int | None = None) -> dict:
    result = None if incident or rank is None else {"rank": rank, "final_step": 8, "model_digest": f"d{rank}"}
    return {
        "node": node,
        "node_rank": int(node[-1]),
        "result": result,
        "incident": incident.model_dump(mode="json") if incident else None,
        "findings": [],
    }


def crash(node: str, rank: int | None, signal: str | None) -> Incident:
    return Incident(kind="crash", detail="…", node=node, rank=rank, error=signal)


def test_the_attempt_succeeded_only_when_every_host_finished_and_its_result_is_rank_0s():
    done = job_outcome([part("h1", rank=1), part("h0", rank=0)])
    assert done["incident"] is None and done["result"]["model_digest"] == "d0"
    assert done["hosts"] == [(0, "h0", True, None), (1, "h1", True, None)]
    half = job_outcome([part("h0", rank=0), part("h1", Incident(kind="aborted", detail="…", node="h1"))])
    assert half["result"] is None and half["incident"]["kind"] == "aborted"


@pytest.mark.parametrize(
    ("parts", "cause"),
    [
        # The rank on h1 was SIGKILLed; the rank on h0 died of the lost connection (exit code 1).
        ([crash("h0", 0, None), crash("h1", 1, "SIGKILL")], ("crash", "h1", 1)),
        # h1's whole agent was killed (no rank known); h0's rank failed after it.
        ([crash("h0", 0, None), crash("h1", None, "SIGKILL")], ("crash", "h1", None)),
        # Node 0's watchdog named a hang; the other host only followed.
        (
            [Incident(kind="hang", detail="…", node="h1", rank=1), Incident(kind="aborted", detail="…", node="h1")],
            ("hang", "h1", 1),
        ),
        # A rank's own report beats the crash that torchrun's teardown made of its peers.
        (
            [crash("h0", 0, "SIGTERM"), Incident(kind="error", detail="…", node="h1", rank=1, error="DataError")],
            ("error", "h1", 1),
        ),
    ],
)
def test_the_cause_is_picked_across_hosts(parts, cause):
    outcome = job_outcome([part(i.node or "?", i) for i in parts])
    found = outcome["incident"]
    assert (found["kind"], found["node"], found["rank"]) == cause


def test_a_host_of_a_multi_host_job_needs_the_shared_token(home, monkeypatch):
    monkeypatch.delenv("TRAINPIPE_BEACON_TOKEN", raising=False)
    prof = load_profile("local", ["cluster.nodes=2", "cluster.node_rank=1", "cluster.master_addr=10.0.0.1"])
    with pytest.raises(ProfileError, match="needs TRAINPIPE_BEACON_TOKEN: the same secret"):
        run_module(prof, "trainpipe.trainer", [], 10, beacons=True)


def test_each_host_runs_c10d_towards_node_0_which_hosts_the_store_and_says_where_it_is_reached(home):
    base = ["cluster.nodes=2", "cluster.master_addr=10.0.0.1", "cluster.master_port=29400"]
    zero = torchrun_command(load_profile("local", [*base, "cluster.local_addr=10.0.0.1"]), "trainpipe.trainer", [])
    one = torchrun_command(load_profile("local", [*base, "cluster.node_rank=1"]), "trainpipe.trainer", [])
    assert "--rdzv-endpoint" in zero and zero[zero.index("--rdzv-endpoint") + 1] == "10.0.0.1:29400"
    assert zero[zero.index("--rdzv-conf") + 1] == "is_host=true" and zero[zero.index("--local-addr") + 1] == "10.0.0.1"
    assert one[one.index("--rdzv-conf") + 1] == "is_host=false" and "--local-addr" not in one  # no name lookup


def test_two_hosts_with_one_name_are_two_hosts_of_the_outcome():
    """Two pods on one Kubernetes node share its name: the outcome keeps them apart by node rank."""
    twin = part("n0", Incident(kind="aborted", detail="…", node="n0")) | {"node_rank": 1}
    outcome = job_outcome([part("n0", rank=0), twin])
    assert outcome["hosts"] == [(0, "n0", True, None), (1, "n0", False, "aborted")]


def test_a_cluster_jobs_result_is_typed_and_one_that_is_not_a_training_result_is_one_line(home):
    """Node 0's part (in a shared folder, or the store under Kubernetes) carries rank 0's result: read back as a
    TrainResult; a part whose result is not one (rewritten by someone who may write there) ends the attempt as
    an error naming the field, and nothing of it is used."""
    from trainpipe.trainer.launch.outcome import hosts_outcome

    prof = load_profile("local", ["cluster.nodes=2", "cluster.procs_per_node=1"])
    good = [part("h0") | {"result": train_result().model_dump(mode="json")}, part("h1") | {"result": {"rank": 1}}]
    good[1]["result"] = train_result(rank=1).model_dump(mode="json")
    args = (prof, 1, "slurm job 7", "slurm job 7 ended COMPLETED", 0)
    outcome = hosts_outcome("train", *args, good, False, 1.0, [])
    assert outcome.incident is None and outcome.result == train_result() and outcome.succeeded
    forged = [good[0] | {"result": {**good[0]["result"], "final_step": "all of them"}}, good[1]]
    outcome = hosts_outcome("train", *args, forged, False, 1.0, [])
    assert outcome.result is None and not outcome.succeeded
    assert outcome.incident.kind == "error" and "final_step" in outcome.incident.line(), outcome.incident
    report = {"ok": True, "world_size": 2, "nodes": ["h0", "h1"], "failing_nodes": [], "rank": 0, "duration_s": 0.2}
    report |= {"checks": [{"name": "compute.gemm", "status": "pass", "detail": "ok", "ranks": [1]}], "timings_s": {}}
    report |= {"ranks": [{"host": "h0"}, {"host": "h1"}]}
    preflight = hosts_outcome("preflight", *args, [good[0] | {"result": report}, good[1]], False, 1.0, [])
    assert preflight.report["nodes"] == ["h0", "h1"] and preflight.report["checks"][0]["ranks"] == [1]
    assert preflight.result is None and preflight.succeeded


def test_a_host_whose_part_is_missing_is_the_culprit_not_the_survivor_that_reported(home):
    """Host 1's supervisor was SIGKILLed and wrote nothing; host 0's rank died of the reset connection. The
    attempt names node 1 (by the launcher's node names) and, fed twice to the policy, never excludes host 0."""
    from trainpipe.trainer.launch.outcome import hosts_outcome
    from trainpipe.trainer.orchestrate.policy import after_attempt

    prof = load_profile("local", ["cluster.nodes=2", "cluster.procs_per_node=1", "cluster.min_nodes=1"])
    survivor = part("host0", Incident(kind="crash", detail="connection reset by peer", node="host0", rank=0))
    args = ("train", prof, 1, "slurm job 7", "slurm job 7 ended FAILED (exit code 1:0)", 1, [survivor], False, 1.0, [])
    outcome = hosts_outcome(*args, node_names={0: "host0", 1: "host1"})
    assert outcome.incident.kind == "crash" and outcome.incident.node == "host1", outcome.incident
    assert "node(s) [1]" in outcome.incident.detail and "connection reset" in outcome.incident.detail
    history = [outcome.incident.model_copy(update={"attempt": 1})]
    assert after_attempt(outcome.incident, history, prof).exclude_node == "host1"  # the second time: that host
    unnamed = hosts_outcome(*args)  # a launcher that cannot name it blames nobody rather than the survivor
    assert unnamed.incident.node is None and after_attempt(unnamed.incident, history, prof).exclude_node is None


def test_node_0s_warnings_reach_the_follower_once_while_the_job_runs():
    """What node 0's watchdog finds while a cluster attempt runs (a straggler under warn) goes into its
    progress file at once, and the launcher's follower says each warning once; a planted entry is left out."""
    from trainpipe.trainer.launch.outcome import LiveView
    from trainpipe.trainer.launcher import Watch
    from trainpipe.trainer.supervise.host import ProgressFile

    written: list[dict] = []
    progress = ProgressFile(written.append, every_s=3600)
    progress({0: {"step": 3}})
    slow = Incident(kind="straggler", detail="rank 1 computes 1.5x the median", rank=1, fatal=False)
    progress.finding(slow)
    progress({0: {"step": 4}})  # written at once although every_s has not passed: a warning is news
    assert [len(w["findings"]) for w in written] == [0, 1]
    heard, seen = [], []
    view = LiveView(Watch(on_finding=heard.append, on_progress=seen.append))
    planted = {**written[-1], "findings": [*written[-1]["findings"], {"kind": "nonsense"}]}
    view(planted)
    view(written[-1])
    assert [f.id for f in heard] == [slow.id] and seen[-1] == {0: {"step": 4}}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (b"not json", "host-1.json is not node 1's part of the job ('the document': Invalid JSON"),
        (b'{"node": "h1", "node_rank": "one"}', "('node_rank': Input should be a valid integer"),
        (b'{"node": "h1", "node_rank": 1, "command": "rm -rf /"}', "('command': Extra inputs are not permitted;"),
        (b'[{"node": "h1"}]', "('the document': Input should be an object;"),
        (b'{"node": "h1", "node_rank": 0}', "(it says node rank 0;"),  # a second part for node 0
        (b'{"node": "h1\\nerror: x", "node_rank": 1}', "('node': Value error, not a node's name;"),
        (b'{"node": "h1", "node_rank": 1, "progress": {"x": {}}}', "('progress.x.[key]': Input should be a valid"),
        (b'{"node": "h1", "node_rank": 1, "progress": {"0": {"step": "9"}}}', "a rank's step is not a number"),
        (b'{"node": "h1", "node_rank": 1, "wall_s": NaN}', "('wall_s': Input should be a finite number"),
        (b'{"node": "h1", "node_rank": 1, "first_step_at": Infinity}', "('first_step_at': Input should be a finite"),
        (b'{"node": "h1", "node_rank": 1, "progress": {"0": {"step": 1, "time": NaN}}}', "time is not a finite"),
        (b'{"node": "h1", "node_rank": 1, "findings": [' + b",".join([b'{"kind": "straggler", "detail": "x"}'] * 300)
         + b"]}", "('findings': List should have at most 256 items"),
        (b"{" + b" " * (17 * 2**20) + b"}", "(larger than 16 MiB;"),
        (None, "(not a regular file: a directory;"),
    ],
)  # fmt: skip
def test_a_host_part_that_is_not_one_is_left_out_said_in_one_line_and_blamed_on_nobody(home, tmp_path, text, says):
    """Host parts lie where others may write (a shared folder; the store under Kubernetes): each is read as a
    bounded regular file by its model, and one that is not its node's part counts as missing, with why, never
    a traceback, and is not blamed on its node (someone else may have written it)."""
    from fsspec.implementations.local import LocalFileSystem

    from trainpipe.trainer.launch.outcome import hosts_outcome, read_host_parts

    prof = load_profile("local", ["cluster.nodes=2", "cluster.procs_per_node=1"])
    good = part("host0", rank=None) | {"result": train_result().model_dump(mode="json")}
    (tmp_path / "host-0.json").write_text(json.dumps(good))
    if text is None:
        (tmp_path / "host-1.json").mkdir()
    else:
        (tmp_path / "host-1.json").write_bytes(text)
    (tmp_path / "host-7.json").write_text(json.dumps(good | {"node_rank": 7}))  # no node 7 in this job: ignored
    read = read_host_parts(LocalFileSystem(), [str(p) for p in tmp_path.glob("host-*.json")], nodes=2)
    assert [p["node"] for p in read.parts] == ["host0"] and read.left_out == {1}
    assert says in read.problem, read.problem
    args = ("train", prof, 1, "slurm job 7", "slurm job 7 ended COMPLETED", 0, read.parts, False, 1.0, [])
    outcome = hosts_outcome(*args, node_names={0: "host0", 1: "host1"}, unreadable=read)
    assert outcome.result is None and (outcome.incident.kind, outcome.incident.node) == ("crash", None)
    assert says in outcome.incident.line() and "\n" not in outcome.incident.line()


def test_parts_that_add_up_to_no_result_and_no_reason_are_still_an_incident(home):
    """Every host wrote a part, none finished and none says why (as a forged set of parts could): the attempt
    still ends with an incident, so the task never meets an outcome with neither."""
    from trainpipe.trainer.launch.outcome import hosts_outcome

    prof = load_profile("local", ["cluster.nodes=2", "cluster.procs_per_node=1"])
    parts = [part("host0"), part("host1")]
    outcome = hosts_outcome("train", prof, 1, "slurm job 7", "ended", 0, parts, False, 1.0, [])
    assert outcome.result is None and outcome.incident.kind == "error", outcome.incident
    bad = part("host0") | {"result": {"ok": True, "nodes": ["h0"], "rank": 0}}  # a preflight report missing fields
    other = part("host1") | {"result": {"rank": 1}}  # another host's part of a preflight that finished
    outcome = hosts_outcome("preflight", prof, 0, "slurm job 8", "ended", 0, [bad, other], False, 1.0, [])
    assert outcome.report is None and outcome.incident.kind == "error" and "preflight report" in outcome.incident.line()
