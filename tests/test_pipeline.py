"""End to end through the CLI, as a user runs it: Prefect (embedded server), MLflow (SQLite), torchrun, the store."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import NO_PUBLISH, SUMMARY_FIELDS, TINY, prefect_api, prefect_client, run_cli
from trainpipe.trainer import tracking
from trainpipe.trainer.checkpoint import catalog

pytestmark = pytest.mark.integration


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def error_line(stderr: str) -> str:
    """The one ``error:`` line the CLI prints for an expected failure (Prefect's own log lines may surround it)."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One full pipeline run on the local profile with a tiny model."""
    home = tmp_path_factory.mktemp("e2e") / "home"
    env = {"TRAINPIPE_HOME": str(home)}
    proc = run_cli("run", "-p", "local", *sets(*TINY), "--run-name", "e2e", "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"home": home, "env": env, "summary": last_json(proc.stdout), "proc": proc}


def test_run_prints_the_summary_contract(finished):
    s = finished["summary"]
    assert set(s) >= SUMMARY_FIELDS
    assert s["run_name"] == "e2e" and s["final_step"] == 8 and s["recoveries"] == 0 and s["incidents"] == []
    assert 0 < s["val_loss"] < math.log(256)
    assert 0 < s["goodput"] <= 1 and s["wall_s"] > 0
    b = s["badput"]  # every second of the command in one bucket, and the named ones explain nearly all of it
    assert b["productive_s"] + sum(b["buckets"].values()) == pytest.approx(s["wall_s"], rel=0.01)
    assert min(b["buckets"].values()) >= 0 and b["buckets"]["other"] < 0.05 * s["wall_s"], b
    assert all(b["buckets"][k] > 0 for k in ("orchestration", "shard", "preflight", "startup", "teardown", "validate"))
    assert b["buckets"]["evaluation"] > 0 and b["buckets"]["checkpoint"] > 0 and b["productive_s"] > 0, b
    assert [a["attempt"] for a in b["attempts"]] == [1]
    assert s["goodput"] == pytest.approx(b["productive_s"] / s["wall_s"], abs=1e-3)
    assert s["checkpoint_uri"].endswith("runs/e2e/checkpoints/step-00000008")
    out = finished["proc"].stderr  # with --json the summary's text is there, and stdout is the JSON alone
    assert "mlflow ui --backend-store-uri sqlite:///" in out and s["checkpoint_uri"] in out
    assert json.loads(finished["proc"].stdout) == s


def test_a_run_ends_with_a_registered_model_that_loads_on_a_fresh_interpreter(finished):
    """``make run``'s product: version 1 of the profile's registered model, candidate and champion, loaded back
    by mlflow.pyfunc (generating text) and by stock transformers from the registry's files."""
    s = finished["summary"]
    p = s["published"]
    assert (p["registered_model"], p["version"], p["aliases"]) == ("trainpipe-local", "1", ["candidate", "champion"])
    assert p["gate"].startswith("promoted: no champion yet") and not p["reused"]
    out = finished["proc"].stderr
    assert "model:      trainpipe-local version 1 (candidate, champion)" in out
    assert 'load it:    mlflow.pyfunc.load_model("models:/trainpipe-local@champion")' in out
    script = (
        "import json, sys, mlflow, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "mlflow.set_tracking_uri(sys.argv[1])\n"
        "text = mlflow.pyfunc.load_model('models:/trainpipe-local@champion').predict(['def main():'])[0]\n"
        "path = mlflow.artifacts.download_artifacts('models:/trainpipe-local@champion')\n"
        "lm = AutoModelForCausalLM.from_pretrained(path + '/model')\n"
        "tok = AutoTokenizer.from_pretrained(path + '/components/tokenizer')\n"
        "ids = tok('def main():', return_tensors='pt').input_ids\n"
        "out = lm.generate(ids, max_new_tokens=5, do_sample=False)\n"
        "print(json.dumps({'pyfunc': text, 'generated': tok.decode(out[0])}))\n"
    )
    uri = f"sqlite:///{finished['home']}/mlflow.db"
    proc = subprocess.run(
        [str(Path(os.sys.executable)), "-c", script, uri],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=finished["home"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = last_json(proc.stdout)
    assert loaded["pyfunc"].startswith("def main():") and len(loaded["pyfunc"]) > len("def main():")
    assert loaded["generated"].startswith("def main():") and len(loaded["generated"]) == len("def main():") + 5


def test_mlflow_holds_params_metrics_and_artifacts(finished):
    s, home = finished["summary"], finished["home"]
    uri = f"sqlite:///{home}/mlflow.db"
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(s["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "8" and run.data.params["cluster.procs_per_node"] == "2"
    # the keys a person changes to change what it trains, never its name: every run would differ by it
    assert not {"train.run_name", "store.root", "watchdog.hang_timeout_s"} & set(run.data.params)
    assert len(run.data.params) <= 60, sorted(run.data.params)
    assert run.data.tags[tracking.RUN_NAME_TAG] == "e2e" and run.data.tags["prefect.flow_run_id"]
    losses = tracking.metric_history(uri, s["mlflow_run_id"], "loss/train")
    assert sorted(step for step, _ in losses) == list(range(1, 9))
    assert losses[-1][1] < losses[0][1]  # the loss went down
    for key in ("train/lr", "train/grad_norm", "perf/step_ms", "perf/tokens_per_s", "loss/eval", "perf/ckpt_save_s"):
        assert tracking.metric_history(uri, s["mlflow_run_id"], key), key
    # single figures are summary tags (runs-table columns, rounded), not one-point charts; but the two that runs
    # are sorted, filtered and plotted by are metrics too, exact
    assert not [k for k in run.data.metrics if k.startswith(("run/", "eval/"))], sorted(run.data.metrics)
    assert float(run.data.tags["summary.goodput"]) == round(s["goodput"], 4)
    summary_tags = sorted(k.removeprefix("summary.") for k in run.data.tags if k.startswith("summary."))
    assert summary_tags == sorted(tracking.SUMMARY_TAGS), summary_tags  # a few columns: the rest in summary.json
    assert float(run.data.tags["summary.validated_loss"]) == round(s["val_loss"], 4)
    assert (run.data.metrics["validated_loss"], run.data.metrics["goodput"]) == (s["val_loss"], s["goodput"])
    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(s["mlflow_run_id"])}
    assert {"profile.yaml", "preflight.json", "summary.json", "checkpoint"} <= artifacts


def test_the_shard_stage_reports_its_progress_as_a_prefect_artifact(finished):
    from uuid import UUID

    from mlflow.tracking import MlflowClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    run = MlflowClient(f"sqlite:///{finished['home']}/mlflow.db").get_run(finished["summary"]["mlflow_run_id"])
    flow_run_id = UUID(run.data.tags["prefect.flow_run_id"])
    with prefect_client(prefect_api()) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=["progress"])
            )
        )
    shard = [(a.data, a.description) for a in artifacts if a.description.startswith("shard")]
    assert shard == [(100, f"shard stdlib: dataset {finished['summary']['dataset_id']} written")]
    # and MLflow has the dataset's size and what sharding it took
    metrics = run.data.metrics
    assert metrics["shard/pieces"] == 1 and metrics["shard/pieces_reused"] == 0
    assert 0 < metrics["shard/source_mb"] <= 4 and metrics["shard/tokenized_mb"] == metrics["shard/source_mb"]
    assert metrics["shard/shard_mb_per_s"] > 0 and metrics["shard/train_tokens"] > 0


def test_ckpt_inspect_and_validate_agree_with_the_summary(finished, cli, monkeypatch):
    s, env = finished["summary"], finished["env"]
    monkeypatch.setenv("TRAINPIPE_HOME", str(finished["home"]))  # the catalog commands in-process: no Prefect
    code, out, err = cli("ckpt", "inspect", s["checkpoint_uri"], "--json")
    assert code == 0, err
    info = last_json(out)
    assert info["valid"] and info["step"] == 8 and info["world_size"] == 2 and info["model_digest"] == s["model_digest"]
    code, out, err = cli("ckpt", "list", "e2e", "--json")
    assert code == 0 and [d["step"] for d in last_json(out)] == [4, 8], err
    val = run_cli("validate", s["checkpoint_uri"], "--json", env=env)
    assert val.returncode == 0, val.stderr[-2000:]
    assert last_json(val.stdout)["model_digest"] == s["model_digest"]


def test_a_resume_under_other_weights_settings_is_refused_before_anything_is_written(finished):
    """Extending train.steps is a resume; another seed or model would continue the old weights on new settings."""
    run_dir = finished["home"] / "store" / "runs" / "e2e"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = run_cli(
        "run", "-p", "local", *sets(*TINY, "train.seed=7", "model.n_layer=2", "train.steps=12"),
        "--run-name", "e2e", env=finished["env"],
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert "run e2e resumes from step-00000008, trained with other settings" in line
    assert "model.n_layer (1 → 2)" in line and "train.seed (1337 → 7)" in line and "train.steps (" not in line
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # profile.yaml included


def test_validate_rebuilds_the_model_the_checkpoint_records_not_what_the_run_folder_says(finished, tmp_path):
    import shutil

    src = Path(finished["summary"]["checkpoint_uri"])
    copy = tmp_path / "runs" / "x" / "checkpoints" / src.name
    shutil.copytree(src, copy)
    (tmp_path / "runs" / "x" / "profile.yaml").write_text("model:\n  n_layer: 3\n  n_embd: 96\n")  # rewritten since
    proc = run_cli("validate", str(copy), "--json", *sets("model.n_layer=4"), env=finished["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc.stdout)["model_digest"] == finished["summary"]["model_digest"]


def test_ckpt_list_refuses_a_run_name_that_is_not_one(home, cli):
    code, _, err = cli("ckpt", "list", "e2e*")
    assert code == 2 and "run name 'e2e*' is not valid" in error_line(err)


def test_corrupt_checkpoint_fails_validation_with_the_file_named(finished, tmp_path):
    import shutil

    src = Path(finished["summary"]["checkpoint_uri"])
    copy = tmp_path / "runs" / "x" / "checkpoints" / src.name
    shutil.copytree(src, copy)
    victim = sorted(copy.glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:-10])
    proc = run_cli("validate", str(copy), env=finished["env"])
    assert proc.returncode == 2
    assert victim.name in error_line(proc.stderr)


PLANTED = {  # credentials a user puts in a profile: from the environment, nested, and inside a URL
    "TP_PLANTED_ACCESS_KEY": "AKIAPLANTED7Q2W9E4R",
    "TP_PLANTED_SECRET_KEY": "planted-secret-Zx81Lq0v",
}
PLANTED_LITERAL = ["planted-session-Hb62Tm", "planted-proxy-Pw55Kd"]


class Watch:
    """Every command line on the machine and every new file under the temp folder, sampled while a run runs."""

    def __init__(self):
        import tempfile
        import threading
        import time

        self.start, self.tmp = time.time(), Path(tempfile.gettempdir())
        self.seen: dict[str, bytes] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self) -> None:
        import psutil

        while not self.stop.wait(0.3):
            for p in psutil.process_iter(["cmdline"]):
                self.seen[f"ps:{p.pid}"] = " ".join(p.info["cmdline"] or []).encode()
            for top in self.tmp.iterdir():
                try:
                    if top.stat().st_ctime < self.start or not top.is_dir():
                        continue
                    for f in top.rglob("*"):
                        if f.is_file() and f.stat().st_size < 4 << 20:
                            self.seen[str(f)] = f.read_bytes()
                except OSError:
                    continue  # gone while read

    def done(self) -> dict[str, bytes]:
        self.stop.set()
        self.thread.join()
        return self.seen


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(f): f.read_bytes() for f in folder.rglob("*") if f.is_file()}


def test_pipeline_on_s3_records_no_credential_anywhere(s3_bucket, home, tmp_path, monkeypatch):
    """The same pipeline with datasets, checkpoints, the run record and MLflow artifacts on a real S3 API
    (moto_server); the credentials planted in its profile appear in nothing the run writes or shows."""
    import os

    import s3fs

    bucket, options = s3_bucket  # the endpoint reaches the run through the standard AWS variable
    profile = tmp_path / "s3-secrets.yaml"
    profile.write_text(
        "store:\n"
        f"  root: s3://{bucket}/tp\n"
        "  storage_options:\n"
        "    key: ${TP_PLANTED_ACCESS_KEY}\n"
        "    secret: ${TP_PLANTED_SECRET_KEY}\n"
        f"    client_kwargs: {{aws_session_token: {PLANTED_LITERAL[0]}}}\n"
        f"    config_kwargs: {{proxies: {{ftp: 'http://someone:{PLANTED_LITERAL[1]}@proxy.invalid:3128'}}}}\n"
    )
    env = {**PLANTED, "TRAINPIPE_PROFILES": str(tmp_path)}
    watch = Watch()
    proc = run_cli("run", "-p", str(profile), *sets(*TINY), "--run-name", "s3run", "--json", env=env)
    seen = watch.done()
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = last_json(proc.stdout)
    assert s["checkpoint_uri"] == f"s3://{bucket}/tp/runs/s3run/checkpoints/step-00000008"
    fs = s3fs.S3FileSystem(**options)
    assert fs.exists(f"{bucket}/tp/runs/s3run/checkpoints/step-00000008/trainpipe.json")
    assert fs.glob(f"{bucket}/tp/datasets/*/manifest.json")
    assert fs.glob(f"{bucket}/tp/mlflow/*/*/artifacts/profile.yaml") or fs.glob(f"{bucket}/tp/mlflow/**/profile.yaml")
    assert catalog.inspect_checkpoint(s["checkpoint_uri"], options).valid

    written = {f"s3://{k}": fs.cat_file(k) for k in fs.find(bucket)}
    written |= files_under(home)  # the MLflow database and anything else under TRAINPIPE_HOME
    written |= files_under(Path(os.environ["PREFECT_HOME"]))  # the Prefect server's database and log
    written |= {"stdout": proc.stdout.encode(), "stderr": proc.stderr.encode()}
    written |= seen
    written.pop(str(profile), None)  # the test's own profile, which holds them (the watch may list its folder)
    assert len(seen) > 10 and any("trainpipe-job-" in k for k in seen)  # the watch saw the job's files
    secrets = [*PLANTED.values(), *PLANTED_LITERAL]
    leaks = sorted(
        {(where, secret) for where, body in written.items() for secret in secrets if secret.encode() in body}
    )
    assert not leaks, leaks


def test_failing_preflight_stops_before_training(home):
    # Only the all-reduce may fail: a loaded machine must not fail the GEMM comparison first.
    proc = run_cli(
        "run",
        *sets(*TINY, "preflight.max_allreduce_ms=0.000001", "preflight.max_compute_slowdown=100"),
        "--run-name",
        "pf",
    )
    assert proc.returncode == 2
    assert error_line(proc.stderr).startswith("error: preflight check collective.allreduce failed")
    assert not (home / "store" / "runs" / "pf" / "checkpoints").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        (sets("train.stpes=3"), "unknown key 'train.stpes'"),
        (sets("train.steps=abc"), "train.steps"),
        (sets("train.global_batch=10"), "not divisible"),
        (sets("cluster.nodes=1", "cluster.min_nodes=2"), "min_nodes"),
        (sets("data.source=/nonexistent/*.txt"), "matched no files"),
        (sets("store.root=/proc/trainpipe"), "not writable"),
        (["-p", "no-such-profile"], "unknown profile"),
        (sets("store.storage_options={endpoint_url: x}"), "cannot be set as a parameter"),
        (["--run-name", "../../x"], "run_name: String should match pattern"),
        (["--resume", "never-ran"], "there is no run 'never-ran' to resume"),
        (sets("watchdog.hang_timeout_s=.inf"), "watchdog.hang_timeout_s: Input should be a finite number"),
        (sets("watchdog.stack_dump_s=.nan"), "watchdog.stack_dump_s: Input should be a finite number"),
        (["-p", "{tmp}/loop.yaml"], "aliases (*a) are not allowed in a profile"),
        (["-p", "{tmp}/latin1.yaml"], "not UTF-8 text (byte 27); save the profile as UTF-8"),
        (["-p", "{tmp}/deep.yaml"], "nested too deeply to be a profile"),
        (sets("data.tokenizer=bpe"), "model.vocab_size=256 is below data.vocab_size=4096 of the bpe tokenizer"),
        (sets("data.tokenizer={tmp}/tok.json"), "tok.json: not a tokenizer.json the tokenizers library loads"),
        (sets("data.source={tmp}/c.parquet", "data.text_field=body"), "no column 'body' (its columns: text)"),
        (sets("data.source={tmp}/c.jsonl", "data.text_field=body"), "line 1: no field 'body' (its fields: text)"),
    ],
)
def test_bad_input_is_one_line_before_anything_runs(home, tmp_path, args, expected, cli):
    (tmp_path / "loop.yaml").write_text("train: &a\n  steps: 3\n  x: *a\n")
    (tmp_path / "latin1.yaml").write_bytes(b"tracking:\n  experiment: caf\xe9\n")
    (tmp_path / "deep.yaml").write_text("train: " + "[" * 5000 + "]" * 5000 + "\n")
    (tmp_path / "tok.json").write_text('{"model": {"type": "BPE"}}')
    (tmp_path / "c.jsonl").write_text('{"text": "a document"}\n')
    pq.write_table(pa.table({"text": ["a document"]}), tmp_path / "c.parquet")
    code, _, err = cli("run", *(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert not (home / "store" / "runs").exists()


def test_the_command_exits_0_after_help_and_2_for_a_usage_error():
    """What a shell script checks: argparse's own exits keep their codes through ``main``'s exit handler."""
    from tests.conftest import BIN

    def trainpipe(*args: str) -> subprocess.CompletedProcess:  # no Prefect server: argparse exits before one
        return subprocess.run([str(BIN / "trainpipe"), *args], capture_output=True, text=True, timeout=60)

    helped = trainpipe("run", "--help")
    assert helped.returncode == 0 and "--run-name" in helped.stdout, helped
    refused = trainpipe("run", "--no-such-flag")
    assert refused.returncode == 2 and "unrecognized arguments: --no-such-flag" in refused.stderr, refused


@pytest.mark.parametrize("command", [["shard"], ["preflight"], ["validate", "/nonexistent/step-00000001"]])
def test_every_command_refuses_credentials_on_its_command_line(home, command, cli):
    code, _, err = cli(*command, *sets("tracking.tracking_uri=postgresql://u:hunter2hunter2@db/mlflow"))
    assert code == 2
    assert error_line(err).startswith("error: tracking.tracking_uri cannot be set as a parameter")
    assert "hunter2hunter2" not in err and not (home / "store").exists()


def test_unreachable_store_is_one_line(home, cli, monkeypatch):
    import s3fs

    from tests.conftest import free_port

    dead = {
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "AWS_MAX_ATTEMPTS": "1",
    }
    for name, value in dead.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client would know another endpoint
    code, _, err = cli("run", *sets("store.root=s3://nobucket/tp"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "store s3://nobucket/tp is not reachable (EndpointConnectionError" in lines[0], err


def test_validate_missing_checkpoint_is_one_line(home, cli):
    code, _, err = cli("validate", str(home / "runs" / "none" / "checkpoints" / "step-00000001"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0], err


def test_a_cli_run_cancelled_through_the_api_or_killed_is_resumed_by_the_next_start(home, cli):
    """The CLI runs the flow in its own process, with no runner to stop it: it notices a cancel itself (one line,
    exit 130, the job gone, checkpoints kept). A SIGKILL of that process leaves the flow run Running and the lease
    behind; the next start of the run name takes the lease over, marks that flow run Crashed, and resumes."""
    import subprocess
    import time

    from prefect.states import Cancelling

    from tests.conftest import BIN, ROOT, cli_env, prefect_api, prefect_client

    slow = [*TINY, "train.steps=60", "checkpoint.every_steps=5", "preflight.enabled=false", "faults.kind=slow"]
    slow += ["faults.factor=30", "faults.rank=1", "faults.attempts=0", NO_PUBLISH]
    run_dir = home / "store" / "runs" / "cli"

    def start_and_wait_for_a_commit(after: int) -> subprocess.Popen:
        proc = subprocess.Popen(
            [str(BIN / "trainpipe"), "run", *sets(*slow), "--run-name", "cli"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(),
            cwd=ROOT,
        )
        deadline = time.monotonic() + 180
        while len(list((run_dir / "checkpoints").glob("step-*/trainpipe.json"))) <= after:
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was committed"
            time.sleep(0.3)
        return proc

    def flow_runs(client) -> list:
        return sorted((r for r in client.read_flow_runs() if r.name == "cli"), key=lambda r: r.created)

    cancelled = start_and_wait_for_a_commit(after=0)
    with prefect_client(prefect_api()) as client:
        client.set_flow_run_state(flow_runs(client)[0].id, Cancelling(), force=True)
        t0 = time.monotonic()
        _, stderr = cancelled.communicate(timeout=60)
        stopped_s = time.monotonic() - t0
        deadline = time.monotonic() + 15  # the server may record the final state a moment after the process ended
        while not flow_runs(client)[0].state.is_cancelled() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert flow_runs(client)[0].state.is_cancelled(), flow_runs(client)[0].state
    assert cancelled.returncode == 130 and stopped_s < 30, (cancelled.returncode, stopped_s)
    assert "run cli was cancelled" in error_line(stderr) and "--run-name cli resumes" in error_line(stderr)
    incidents = json.loads((run_dir / "incidents.json").read_text())
    assert [i["kind"] for i in incidents if i["fatal"]] == ["cancelled"]  # the slowed rank also warns
    uri = f"sqlite:///{home}/mlflow.db"
    (tracked,) = tracking.client(uri).search_runs(
        [tracking.experiment_id(uri, "trainpipe-local")], "tags.`trainpipe.run_name` = 'cli'"
    )
    assert tracked.info.status == "KILLED" and not (run_dir / "lease.json").exists()

    commits = len(list((run_dir / "checkpoints").glob("step-*/trainpipe.json")))
    killed = start_and_wait_for_a_commit(after=commits)
    code, _, err = cli("run", *sets(*slow), "--run-name", "cli")  # a colleague starts the same run meanwhile
    assert code == 2, err
    assert "run cli is being trained by owner" in error_line(err) and f"(pid {killed.pid} on " in error_line(err)
    killed.kill()
    killed.communicate()
    assert json.loads((run_dir / "lease.json").read_text())["pid"] == killed.pid  # left behind

    again = run_cli("run", *sets(*slow, "faults.kind=none"), "--run-name", "cli", "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    summary = last_json(again.stdout)
    assert summary["final_step"] == 60 and summary["mlflow_run_id"] == tracked.info.run_id
    with prefect_client(prefect_api()) as client:
        runs = flow_runs(client)
    assert [r.state.type.value for r in runs] == ["CANCELLED", "CRASHED", "COMPLETED"], [r.state for r in runs]
    assert "took over run cli" in runs[1].state.message
    (takeover,) = [i for i in json.loads((run_dir / "incidents.json").read_text()) if i["kind"] == "takeover"]
    assert f"pid {killed.pid}" in takeover["detail"] and not takeover["fatal"]
    attempts = json.loads((run_dir / "attempts.json").read_text())
    assert attempts[-1]["start_step"] >= 10, attempts  # the last commit, two runs in
    # One MLflow run over three starts, and one point per key and step: the steps trained again were not logged
    # twice (a SIGKILLed orchestrator's last unsent points are lost; the resumed steps are all there).
    for key in ("loss/train", "perf/step_ms"):
        steps = [step for step, _ in tracking.metric_history(uri, tracked.info.run_id, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps))
        assert set(range(attempts[-1]["start_step"] + 1, 61)) <= set(steps), (key, sorted(steps))
    system = [k for k in tracking.last_logged_steps(uri, tracked.info.run_id) if k.startswith("system/")]
    assert system  # each host's samples continue the run's numbering in every attempt
    for key in system:
        steps = [step for step, _ in tracking.metric_history(uri, tracked.info.run_id, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps))


SIMULATED_SLOW = [
    *TINY,
    "train.steps=80",
    "preflight.enabled=false",
    "faults.kind=slow",
    "faults.factor=30",
    "faults.rank=1",
    "faults.attempts=0",
    "cluster.nodes=2",
    "cluster.procs_per_node=1",
    "cluster.simulate_nodes=true",
    "train.micro_batch=4",
]


def _start_cli_and_wait_for_the_ranks(env: dict, server: bool):
    """`trainpipe run` of two simulated nodes in the background, once both ranks run: (process, its family)."""
    import contextlib
    import subprocess
    import time

    import psutil

    from tests.conftest import BIN, ROOT

    proc = subprocess.Popen(
        [str(BIN / "trainpipe"), "run", *sets(*SIMULATED_SLOW), "--run-name", "sim"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        with contextlib.suppress(psutil.Error):
            family = psutil.Process(proc.pid).children(recursive=True)
            if sum(p.name().startswith("trainpipe-r") for p in family) == 2:
                break
        time.sleep(0.3)
    names = " ".join(" ".join(p.cmdline()) for p in family)
    assert names.count("trainpipe.trainer.supervise.agent") >= 2 and ("uvicorn" in names) == server, names
    return proc, family


def _still_running(family, within_s: float = 20) -> list[str]:
    import time

    import psutil

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            return []
        time.sleep(0.3)
    return [f"{p.pid} {' '.join(p.cmdline())[:200]}" for p in left]


def test_a_sigtermed_cli_tears_the_job_down_and_ends_the_mlflow_run_killed(home):
    """`trainpipe run` with two simulated nodes, SIGTERM: the job is torn down, exit 143 with one line, and the
    MLflow run ends KILLED."""
    import signal

    from tests.conftest import cli_env

    terminated, family = _start_cli_and_wait_for_the_ranks(cli_env(), server=False)
    terminated.send_signal(signal.SIGTERM)
    _, stderr = terminated.communicate(timeout=60)
    assert terminated.returncode == 143, stderr[-3000:]
    assert "terminated (SIGTERM)" in error_line(stderr) and "--run-name resumes" in error_line(stderr)
    assert not _still_running(family)
    uri = f"sqlite:///{home}/mlflow.db"
    (tracked,) = tracking.client(uri).search_runs(
        [tracking.experiment_id(uri, "trainpipe-local")], "tags.`trainpipe.run_name` = 'sim'"
    )
    assert tracked.info.status == "KILLED"


# the default suite SIGKILLs a CLI run on the shared server above (its agent and ranks go with it); this variant
# adds the embedded server's own process and two simulated nodes' agents
def test_a_sigkilled_cli_leaves_no_process_behind_simulated_nodes_and_embedded_server_included(home, tmp_path):
    """`trainpipe run` with two simulated nodes on Prefect's embedded server, SIGKILL: nothing can run in that
    process, yet the agents, ranks and the embedded server (a uvicorn process Prefect stops only at a normal exit)
    are all gone."""
    import contextlib
    import os
    import sqlite3

    import psutil

    from tests.conftest import prefect_api

    prefect_api()  # the session's server has migrated its database: a copy spares the embedded one that
    prefect_home = tmp_path / "prefect"
    prefect_home.mkdir()
    src = sqlite3.connect(Path(os.environ["PREFECT_HOME"]) / "prefect.db")
    dst = sqlite3.connect(prefect_home / "prefect.db")
    src.backup(dst)
    src.close(), dst.close()
    embedded = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    embedded |= {"PREFECT_HOME": str(prefect_home), "TRAINPIPE_HOME": str(home)}

    killed, family = _start_cli_and_wait_for_the_ranks(embedded, server=True)
    killed.kill()
    killed.wait(timeout=30)  # not communicate(): a survivor would hold the output pipes open
    left = _still_running(family)
    for p in family if left else []:  # a failed test leaves nothing running either
        with contextlib.suppress(psutil.Error):
            p.kill()
    killed.stdout.close(), killed.stderr.close()
    assert not left, f"left running after a SIGKILL of trainpipe run: {left}"


def test_a_missing_bucket_is_one_line_at_once_and_not_created(home, cli, s3_bucket):
    import s3fs

    _, options = s3_bucket  # the endpoint reaches the run through the standard AWS variable
    code, _, err = cli("run", "--set", "store.root=s3://tp-no-such-bucket/store")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: store s3://tp-no-such-bucket/store: bucket 'tp-no-such-bucket' does not exist")
    assert not s3fs.S3FileSystem(**options, skip_instance_cache=True).exists("tp-no-such-bucket")


def test_wrong_credentials_are_one_line_at_once(home, cli, monkeypatch):
    """A moto_server that checks credentials (as S3 does): a key it does not know is refused (403), which no
    retry fixes, so the run stops at once with one line naming the credentials."""
    import s3fs

    from tests.conftest import BIN, free_port, stop, wait_port

    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},  # moto's switch for checking every request
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_port(port, proc)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        s3fs.S3FileSystem.clear_instance_cache()
        t0 = time.monotonic()
        code, _, err = cli("run", "--set", "store.root=s3://trainpipe/store")
    finally:
        stop(proc)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: store s3://trainpipe/store is not writable (PermissionError"), err
    assert "credentials" in err and time.monotonic() - t0 < 10


COUNT_RESOLUTIONS = """
import json, sys
from trainpipe.flows.cli import run_command
from trainpipe.trainer.orchestrate import resolve as resolving
calls, check = [], resolving.check_source
resolving.check_source = lambda data, store: calls.append(data.source) or check(data, store)
codes = [run_command(json.loads(argv)) for argv in sys.argv[1:]]
print(json.dumps({"codes": codes, "calls": calls, "left": len(resolving._HANDED)}))
"""


def test_a_cli_run_resolves_its_request_once(home):
    """The CLI resolves the request (profile, overrides, run name; the store, data source and tokenizer checked)
    before Prefect starts, and the flow it then runs in the same process trains with that, not a second
    resolution; the shard command the same."""
    import subprocess
    import sys

    from tests.conftest import ROOT, cli_env

    run = ["run", *sets(*TINY, "preflight.enabled=false", NO_PUBLISH), "--run-name", "once"]
    argv = [sys.executable, "-c", COUNT_RESOLUTIONS, json.dumps(run), json.dumps(["shard", *sets(*TINY)])]
    proc = subprocess.run(argv, capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted = last_json(proc.stdout)
    assert counted == {"codes": [0, 0], "calls": ["stdlib", "stdlib"], "left": 0}, counted  # one for each command


# The last two of the module's uses of `finished` start it again: its MLflow run's single figures become the
# second start's.
def test_a_finished_run_started_again_publishes_without_training_again(finished):
    proc = run_cli("run", "-p", "local", *sets(*TINY), "--run-name", "e2e", "--json", env=finished["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = last_json(proc.stdout)
    assert again["final_step"] == 8 and again["model_digest"] == finished["summary"]["model_digest"]
    assert again["published"]["version"] == "1" and again["published"]["reused"] is True
    versions = tracking.client(f"sqlite:///{finished['home']}/mlflow.db").search_model_versions(
        "name = 'trainpipe-local'"
    )
    assert len(versions) == 1


# Last of the module's uses of `finished`: it leaves the run's MLflow run FAILED, as a failed publish does.
def test_a_name_the_registry_refuses_fails_publishing_alone_in_one_line(finished):
    before = catalog.inspect_checkpoint(finished["summary"]["checkpoint_uri"]).manifest
    proc = run_cli(
        "run",
        "-p",
        "local",
        *sets(*TINY, "publish.registered_model=team/model"),
        "--run-name",
        "e2e",
        env=finished["env"],
    )
    assert proc.returncode == 2
    line = error_line(proc.stderr)
    assert line.startswith(
        f"error: training succeeded (checkpoint {finished['summary']['checkpoint_uri']} validated, val loss "
    )
    assert "and publishing did not: the model registry at sqlite:///" in line
    assert "refused to read registered model 'team/model': Invalid model name 'team/model'" in line
    assert line.endswith("the same --run-name publishes it without training again")
    after = catalog.inspect_checkpoint(finished["summary"]["checkpoint_uri"])
    assert after.valid and after.manifest == before
    # the MLflow run says the same: failed, training's figures kept, and why nothing was published
    run = tracking.client(f"sqlite:///{finished['home']}/mlflow.db").get_run(finished["summary"]["mlflow_run_id"])
    assert run.info.status == "FAILED"
    assert run.data.tags["summary.published"].startswith("not published: the model registry at sqlite:///")
