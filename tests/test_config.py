"""Profiles (trainer/config.py): loading, precedence, expansion, rejection, hashing. Pure logic."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from trainpipe.trainer.config import TrainConfig
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.launch import check_launcher
from trainpipe.trainer.launch.kubernetes import check_train_job, job_name, train_job
from trainpipe.trainer.profile_files import (
    PROFILES_DIR,
    load_profile,
    load_resolved_profile,
    profile_from_yaml,
    with_nodes,
)


def write_profile(folder: Path, text: str, name: str = "custom.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def profile_error(*args) -> str:
    with pytest.raises(ProfileError) as exc:
        load_profile(*args)
    return str(exc.value)


# ---------------------------------------------------------------- loading and precedence


def test_local_profile_matches_its_file(home):
    p = load_profile("local")
    raw = yaml.safe_load((PROFILES_DIR / "local.yaml").read_text())
    assert p.name == "local"
    assert p.cluster.world_size == 2
    assert p.cluster.backend == "gloo"
    assert p.cluster.device == "cpu"
    for section in ("cluster", "model", "train", "checkpoint", "watchdog"):
        for key, value in raw[section].items():
            assert getattr(getattr(p, section), key) == value, f"{section}.{key}"


def test_set_beats_file_beats_defaults(home):
    default_steps = TrainConfig().steps
    file_steps = yaml.safe_load((PROFILES_DIR / "local.yaml").read_text())["train"]["steps"]
    assert file_steps != default_steps  # otherwise the file-beats-default check below proves nothing

    assert load_profile("local").train.steps == file_steps
    assert load_profile("local", ["train.steps=7"]).train.steps == 7

    # A key the file does not set: the model default, unless --set.
    assert load_profile("local").train.seed == TrainConfig().seed
    assert load_profile("local", ["train.seed=5"]).train.seed == 5


def test_later_set_wins(home):
    assert load_profile("local", ["train.steps=7", "train.steps=9"]).train.steps == 9


def test_load_by_path(home, tmp_path):
    path = write_profile(tmp_path, "train: {steps: 3}\n")
    p = load_profile(str(path))
    assert p.name == "custom"
    assert p.train.steps == 3
    assert p.cluster.procs_per_node == 2  # default


def test_numeric_looking_strings_are_strings(home):
    p = load_profile("local", ["tracking.experiment=2024", "train.run_name=20240101"])
    assert p.tracking.experiment == "2024"
    assert p.train.run_name == "20240101"


# ---------------------------------------------------------------- ${TRAINPIPE_HOME}


def test_trainpipe_home_expands(home):
    p = load_profile("local")
    assert p.store.root == f"{home}/store"
    assert p.tracking.tracking_uri == f"sqlite:///{home}/mlflow.db"
    assert "${" not in p.to_yaml()


def test_relative_trainpipe_home_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINPIPE_HOME", "rel/home")
    root = load_profile("local").store.root
    assert os.path.isabs(root)
    assert root == str(tmp_path / "rel" / "home" / "store")


def test_unset_trainpipe_home_defaults_to_dot_trainpipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRAINPIPE_HOME", raising=False)
    assert load_profile("local").store.root == str(tmp_path / ".trainpipe" / "store")


# ---------------------------------------------------------------- rejection: key and where named


def test_unknown_key_in_file(home, tmp_path):
    path = write_profile(tmp_path, "train: {stpes: 3}\n")
    msg = profile_error(str(path))
    assert "train.stpes" in msg
    assert str(path) in msg


def test_unknown_key_in_set(home):
    msg = profile_error("local", ["train.stpes=3"])
    assert "train.stpes" in msg
    assert "--set train.stpes=3" in msg


def test_unknown_section_in_file(home, tmp_path):
    path = write_profile(tmp_path, "trian: {steps: 3}\n")
    msg = profile_error(str(path))
    assert "trian" in msg
    assert str(path) in msg


def test_unknown_section_in_set(home):
    msg = profile_error("local", ["trian.steps=3"])
    assert "trian" in msg
    assert "--set trian.steps=3" in msg


def test_wrong_type_in_set(home):
    msg = profile_error("local", ["train.steps=abc"])
    assert "train.steps" in msg
    assert "--set train.steps=abc" in msg


def test_wrong_type_in_file(home, tmp_path):
    path = write_profile(tmp_path, "model: {n_layer: many}\n")
    msg = profile_error(str(path))
    assert "model.n_layer" in msg
    assert str(path) in msg


def test_global_batch_not_divisible(home):
    msg = profile_error("local", ["train.global_batch=10"])  # micro_batch 4 x world 2
    assert "train.global_batch" in msg
    assert "local.yaml" in msg or "--set train.global_batch=10" in msg


def test_nodes_below_min_nodes(home):
    msg = profile_error("local", ["cluster.min_nodes=2"])  # nodes: 1
    assert "cluster.nodes" in msg and "cluster.min_nodes" in msg
    assert "local.yaml" in msg or "--set cluster.min_nodes=2" in msg


def test_negative_seed_rejected_before_running(home):
    # The sampler seeds numpy's PCG64 with (seed, epoch), which needs a non-negative seed.
    msg = profile_error("local", ["train.seed=-1"])
    assert "train.seed" in msg


@pytest.mark.parametrize("item", ["train.steps", "trainsteps=3", "train.=3", "=3", "train.steps.x.y=3"])
def test_bad_set_syntax(home, item):
    msg = profile_error("local", [item])
    assert "--set" in msg and repr(item) in msg


def test_a_set_inside_a_value_that_is_not_a_mapping_says_so(home):
    """section.key.item sets an item of a mapping (a launcher's own section: launcher.slurm.partition=gpu)."""
    msg = profile_error("local", ["train.steps.x=3"])
    assert msg == "--set train.steps.x=3: train.steps is not a mapping, so nothing can be set inside it"


def test_unknown_profile_name(home):
    msg = profile_error("no-such-profile")
    assert "no-such-profile" in msg
    assert "local" in msg  # lists the known ones


def test_missing_yaml_path(home, tmp_path):
    msg = profile_error(str(tmp_path / "absent.yaml"))
    assert "absent.yaml" in msg


def test_invalid_yaml(home, tmp_path):
    path = write_profile(tmp_path, "train: {steps: 3\n  - oops: [\n")
    msg = profile_error(str(path))
    assert str(path) in msg
    assert "YAML" in msg
    assert "\n" not in msg  # one line for the CLI


def test_top_level_list(home, tmp_path):
    path = write_profile(tmp_path, "- train\n- cluster\n")
    msg = profile_error(str(path))
    assert str(path) in msg
    assert "mapping" in msg


# ---------------------------------------------------------------- derived values


def test_config_hash_stable_and_sensitive(home):
    base = load_profile("local").config_hash()
    assert load_profile("local").config_hash() == base
    assert load_profile("local", ["train.seed=1"]).config_hash() != base
    assert load_profile("local", ["model.n_layer=3"]).config_hash() != base


@pytest.mark.parametrize("item", ["train.run_name=other", "store.root=/elsewhere", "tracking.experiment=other"])
def test_config_hash_ignores_where_and_how_tracked(home, item):
    assert load_profile("local", [item]).config_hash() == load_profile("local").config_hash()


def test_grad_accum(home):
    base = ["train.global_batch=16", "train.micro_batch=4"]
    assert load_profile("local", base).grad_accum == 16 // (4 * 2)
    assert load_profile("local", [*base, "train.global_batch=32"]).grad_accum == 4
    assert load_profile("local", [*base, "cluster.procs_per_node=4"]).grad_accum == 1
    assert load_profile("local", ["train.micro_batch=1", "train.global_batch=6"]).grad_accum == 3


def test_to_yaml_round_trips(home):
    p = load_profile("local", ["train.run_name=r1", "train.betas=[0.8, 0.99]"])
    q = profile_from_yaml(p.to_yaml())
    assert q == p
    assert q.config_hash() == p.config_hash()
    assert q.train.betas == (0.8, 0.99)


def test_flat(home):
    f = load_profile("local", ["train.steps=60"]).flat()
    assert f["name"] == "local"
    assert f["train.steps"] == 60
    assert f["cluster.procs_per_node"] == 2
    assert f["cluster.backend"] == "gloo"
    assert f["store.root"] == f"{home}/store"
    assert all("." in key for key in f if key != "name")


SECRETS = {"TP_TEST_SECRET_KEY": "planted-secret-9f3e1c", "TP_TEST_DB_PASSWORD": "planted-dbpw-77aa01"}


def secret_profile(tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TP_TEST_ENDPOINT", "http://127.0.0.1:9")  # not named like a credential: recorded as is
    path = tmp_path / "secret.yaml"
    path.write_text(
        "store:\n"
        "  root: ${TRAINPIPE_HOME}/store\n"
        "  storage_options:\n"
        "    endpoint_url: ${TP_TEST_ENDPOINT}\n"
        "    client_kwargs: {aws_session_token: planted-session-5521be, region_name: us-east-1}\n"
        "    config_kwargs: {proxies: {https: 'http://proxyuser:planted-proxy-pw@proxy:3128'}}\n"
        "    secret: ${TP_TEST_SECRET_KEY}\n"
        "tracking:\n"
        "  tracking_uri: postgresql://trainer:${TP_TEST_DB_PASSWORD}@db:5432/mlflow\n"
        "  experiment: exp-${TP_TEST_SECRET_KEY}\n"
    )
    return load_profile(str(path))


PLANTED = ["planted-secret-9f3e1c", "planted-dbpw-77aa01", "planted-session-5521be", "planted-proxy-pw"]


def test_public_profile_hides_nested_options_url_passwords_and_expanded_credentials(tmp_path, monkeypatch):
    prof = secret_profile(tmp_path, monkeypatch)
    assert prof.store.storage_options["client_kwargs"]["aws_session_token"] == "planted-session-5521be"  # usable
    recorded = json.dumps([prof.public(), prof.flat()]) + prof.public_yaml()
    assert not [s for s in PLANTED if s in recorded], recorded
    public = prof.public()
    assert public["store"]["storage_options"]["client_kwargs"] == {
        "aws_session_token": "<redacted>",
        "region_name": "us-east-1",
    }
    assert public["store"]["storage_options"]["endpoint_url"] == "http://127.0.0.1:9"
    assert public["tracking"]["tracking_uri"] == "postgresql://<redacted>@db:5432/mlflow"
    assert public["tracking"]["experiment"] == "exp-<redacted>"  # a credential's value, wherever it lands
    smaller = with_nodes(prof, 1, "a test")
    assert not [s for s in PLANTED if s in json.dumps(smaller.public())]


def test_a_jobs_processes_get_the_store_through_the_environment_not_the_profile_file(tmp_path, monkeypatch):
    prof = secret_profile(tmp_path, monkeypatch)
    path = tmp_path / "job-profile.yaml"
    path.write_text(prof.public_yaml())  # what the ranks read
    assert not [s for s in PLANTED if s in path.read_text()]
    for name, value in prof.private_env().items():
        monkeypatch.setenv(name, value)
    ranks = load_resolved_profile(str(path))
    assert ranks.store == prof.store  # the real options, credentials included
    assert not [s for s in PLANTED if s in json.dumps(ranks.public())]  # what a rank writes into a manifest


@pytest.mark.parametrize(
    "override",
    [
        "store.storage_options={secret: x}",
        "tracking.tracking_uri=http://u:p@host",
        "store.root=ftp://user:pw@host/store",
        "data.source=https://token123@example.com/corpus.txt",
    ],
)
def test_credentials_are_refused_as_overrides_for_every_command(override):
    from trainpipe.flows.parameters import refuse_credentials

    with pytest.raises(ProfileError, match="cannot be set as a parameter"):
        refuse_credentials([override])


def test_defaults_a_profile_file_leaves_out_live_under_trainpipe_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPIPE_HOME", str(tmp_path / "home"))
    (tmp_path / "bare.yaml").write_text("train:\n  steps: 3\n")
    prof = load_profile(str(tmp_path / "bare.yaml"))
    assert prof.store.root == f"{tmp_path}/home/store"
    assert prof.tracking.tracking_uri == f"sqlite:///{tmp_path}/home/mlflow.db"


def test_a_key_a_checkpoint_does_not_record_is_compared_with_its_default():
    """A checkpoint from before a key existed was trained as the key's default says; a resume may keep the
    default and may not change it. Sharding settings (buffer, bad-record limit) are free to change."""
    from trainpipe.trainer.orchestrate.resume_pins import resume_differences

    profile = load_profile("local")
    recorded = profile.public()
    for key in ("vocab_size", "eot_token", "tokenizer_sample_mb", "piece_mb"):
        del recorded["data"][key]
    del recorded["cost"]
    assert resume_differences(recorded, profile) == []
    changed = load_profile("local", ["data.vocab_size=8192", "data.buffer_mb=64", "data.max_bad_records=0"])
    assert resume_differences(recorded, changed) == ["data.vocab_size (4096 → 8192)"]


@pytest.mark.parametrize("template", sorted(p.name for p in (PROFILES_DIR / "templates").glob("*.yaml")))
def test_every_cluster_template_is_a_valid_profile_once_its_blanks_are_filled(home, tmp_path, template):
    text = (PROFILES_DIR / "templates" / template).read_text()
    assert "<" in text  # the blanks a user fills in are marked
    filled = tmp_path / template
    text = re.sub(r"<[^>]*e\.g\. /[^>]*>", "/filled/in", text)  # a path the job script holds is absolute
    filled.write_text(re.sub(r"<[^>]*>", "filled-in", text))
    prof = load_profile(str(filled))
    check_launcher(prof)  # its launcher's own section too
    assert prof.cluster.device == "cuda" and prof.cluster.world_size > 8
    assert prof.layout.describe() == "pp 2 × dp_shard 4 × tp 4"  # the 3-D layout docs/profiles.md's table shows
    if prof.launcher.kind == "kubernetes":  # and the TrainJob it makes is one Kubeflow Trainer takes
        job = train_job(prof, "run", "s3://b/d", 1, job_name("run", 1, "ab12"), "s3://b/jobs", "mlflow-run")
        check_train_job(job)
        assert job["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"


def test_the_run_forms_typed_fields_reach_the_profile_as_values_before_the_overrides(home):
    """The form's typed fields are applied as the values they are (no round trip through key=value text), then the
    free-form overrides, which win; a value out of the section's bounds is one error naming where it came from."""
    from trainpipe.flows.parameters import PipelineParameters

    params = PipelineParameters(steps=12, lr=0.01, preflight=False, overrides=["train.steps=14"])
    assert params.profile_values() == {"train.steps": 12, "train.lr": 0.01, "preflight.enabled": False}
    prof = load_profile(params.profile, params.overrides, params.profile_values())
    assert (prof.train.steps, prof.train.lr, prof.preflight.enabled) == (14, 0.01, False)
    with pytest.raises(ProfileError, match=r"^parameter train\.steps=0: "):
        load_profile("local", [], {"train.steps": 0})
    with pytest.raises(ProfileError, match=r"parameter nowhere\.x=1: unknown section 'nowhere'"):
        load_profile("local", [], {"nowhere.x": 1})


def test_the_served_run_form_is_prefilled_with_the_profiles_values_in_plain_boxes_that_name_their_bounds(home):
    """The deployment's schema as the Prefect UI renders it: a typed field is one box of its type (an ``anyOf`` with
    null is a type switch set to None), prefilled with the served profile's value; the server's check of a bad
    value names the bound. Left as served, a field gives way to the chosen profile's own value."""
    from prefect.utilities.schema_tools import ValidationError, validate

    from trainpipe.flows.deployments import pipeline_deployments
    from trainpipe.flows.parameters import PipelineParameters

    served = load_profile("local", ["train.steps=321"])  # `trainpipe serve --set train.steps=321`
    on_demand, nightly = pipeline_deployments(served, "local")
    for deployment in (on_demand, nightly):
        schema = deployment._parameter_openapi_schema.model_dump_for_openapi()
        form = schema["definitions"]["PipelineParameters"]["properties"]
        assert not [name for name, field in form.items() if "anyOf" in field]
        assert (form["steps"]["type"], form["steps"]["default"], form["lr"]["default"]) == ("integer", 321, 0.003)
        assert form["preflight"] == {**form["preflight"], "type": "boolean", "default": True}
        assert "Allowed: 1 to 100,000,000." in form["steps"]["description"]
        assert "Allowed: above 0 to 10." in form["lr"]["description"]
        assert form["run_name"]["type"] == "string" and form["run_name"]["default"] == ""
        validate(deployment.parameters, schema, raise_on_error=True)  # the prefilled form submits as it is
        with pytest.raises(ValidationError, match="0 is less than the minimum of 1"):
            validate({"params": {**deployment.parameters["params"], "steps": 0}}, schema, raise_on_error=True)
    wide = pipeline_deployments(load_profile("local", ["train.max_retries=30"]), "local")[0]
    assert wide.parameters["params"]["max_retries"] is None  # beyond the form's bounds: an empty box, not a crash
    defaults = on_demand.parameters["params"]
    as_served = PipelineParameters.model_validate(defaults)  # what the form shows is what it trains
    assert as_served.run_name is None and as_served.profile_values(served=defaults)["train.steps"] == 321
    other = PipelineParameters.model_validate({**defaults, "profile": "llama-tiny", "steps": 5, "preflight": False})
    assert other.profile_values(served=defaults) == {"train.steps": 5, "preflight.enabled": False}  # the rest: its own


def test_the_built_in_factories_old_names_read_as_todays(home):
    """Runs and checkpoints recorded before the folders were installed under the trainpipe namespace name
    trainer.model:gpt: that is today's built-in GPT, for a resume, a validation and a profile, never an import of
    the bare name (another distribution's package)."""
    from trainpipe.trainer.config import GPT_FACTORY
    from trainpipe.trainer.factory import recorded_factory_problem
    from trainpipe.trainer.orchestrate.resume_pins import resume_differences

    assert load_profile("local", ["model.factory=trainer.model:gpt"]).model.factory == GPT_FACTORY
    prof = load_profile("local")
    recorded = prof.public()
    recorded["model"]["factory"] = "trainer.model:gpt"
    assert resume_differences(recorded, prof) == []
    assert recorded_factory_problem("trainer.hf:causal_lm", None) is None
    assert recorded_factory_problem("trainer.other:x", None) is not None  # only the built-in names


def test_an_item_of_a_launchers_section_is_one_override_and_credentials_stay_refused(home):
    """``--set launcher.slurm.partition=gpu`` sets one item of the Slurm launcher's own section; a credential is
    refused as a parameter at any depth."""
    from trainpipe.flows.parameters import refuse_credentials
    from trainpipe.trainer.errors import ProfileError

    assert refuse_credentials(["launcher.slurm.partition=gpu"]) == ["launcher.slurm.partition=gpu"]
    prof = load_profile("local", ["launcher.slurm.partition=gpu", "launcher.slurm.account=ml"])
    assert prof.launcher.section("slurm") == {"partition": "gpu", "account": "ml"}
    # an item of the store's options is the store's options: endpoint_url would send its credentials elsewhere
    for bad in ("store.storage_options.endpoint_url=http://x", "tracking.tracking_uri.x=y", "a.b.c.d=1"):
        with pytest.raises(ProfileError):
            refuse_credentials([bad])
