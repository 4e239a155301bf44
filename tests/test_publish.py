"""The publish stage in-process (``trainer.orchestrate.publish``), against a real MLflow store (SQLite): the
registered version's lineage, the logged model's links, the gate on recomputed losses, a registry that does not
answer, and who may set what. The stage in the pipeline, through the CLI, is in ``test_pipeline.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from tests.conftest import TINY, free_port
from trainpipe.trainer.checkpoint import catalog
from trainpipe.trainer.checkpoint.validate import validate_checkpoint
from trainpipe.trainer.errors import ProfileError, PublishError
from trainpipe.trainer.orchestrate.publish import publish_checkpoint
from trainpipe.trainer.orchestrate.registry import Registry
from trainpipe.trainer.orchestrate.run_form import check_form_overrides
from trainpipe.trainer.profile_files import load_profile
from trainpipe.trainer.tracking import client, open_run

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("warm_module")]
GPT = ["tracking.enabled=false", "preflight.enabled=false", "train.strategy=ddp", "cluster.procs_per_node=1"]
RUNS = {  # name → settings: one model trained longer than the other, and one on another tokenizer
    "long": [*GPT, "train.steps=24"],
    "short": [*GPT, "train.steps=4", "train.eval_every=2"],
    "bpe": [
        *GPT,
        "train.steps=4",
        "train.eval_every=2",
        "data.tokenizer=bpe",
        "data.vocab_size=512",
        "model.vocab_size=512",
    ],
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name → the validated report of its final checkpoint; and the home they share."""
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.supervise.attempt import train_attempt

    home = tmp_path_factory.mktemp("publish") / "home"
    done = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINPIPE_HOME", str(home))
        for name, sets in RUNS.items():
            prof = load_profile("local", [*TINY, *sets])
            run = train_attempt(prof, name, shard_dataset(prof.data, prof.store).uri)
            assert run.result is not None, "\n".join(run.job.tail[-30:])
            done[name] = validate_checkpoint(run.result.checkpoint_uri, prof)
    done["home"] = home
    return done


@pytest.fixture
def publish(trained, tmp_path, monkeypatch):
    """publish(run, *settings) against a fresh MLflow store of this test; the MLflow run is opened by name."""
    monkeypatch.setenv("TRAINPIPE_HOME", str(trained["home"]))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    count = iter(range(100))

    def call(run: str, *settings: str, tracking_uri: str = uri):
        prof = load_profile(
            "local", [*TINY, f"tracking.tracking_uri={tracking_uri}", "tracking.experiment=tiny", *settings]
        )
        run_id, _ = open_run(uri, "tiny", run)
        work = tmp_path / f"work-{next(count)}"
        work.mkdir()
        return publish_checkpoint(prof, run, run_id, trained[run], work)

    call.uri = uri
    return call


def test_a_version_carries_its_lineage_and_its_logged_model_its_links(trained, publish):
    p = publish("long")
    assert (p.registered_model, p.version, p.aliases) == ("tiny", "1", ["candidate", "champion"])
    c = client(publish.uri)
    v = c.get_model_version("tiny", "1")
    tags, validated = v.tags, trained["long"]
    manifest = catalog.inspect_checkpoint(validated["uri"], verify=False).manifest
    assert tags["trainpipe.run"] == "long" and tags["trainpipe.checkpoint"] == validated["uri"]
    assert tags["trainpipe.dataset_id"] == manifest["dataset_uri"].rsplit("/", 1)[-1]
    assert tags["trainpipe.model_digest"] == validated["model_digest"] == manifest["model_digest"]
    assert tags["trainpipe.state_hash"] == manifest["proof"]["state"]
    assert float(tags["trainpipe.val_loss"]) == pytest.approx(validated["val_loss"], abs=1e-4)
    assert tags["trainpipe.code_version"].startswith(("git:", "trainpipe=="))
    assert tags["trainpipe.gate"] == p.gate.line and p.gate.line.startswith("promoted: no champion yet")
    # the files the registry serves are the ones exported, byte for byte
    import mlflow.artifacts

    from trainpipe.trainer.orchestrate.registry import fluent

    with fluent(publish.uri):
        served = Path(mlflow.artifacts.download_artifacts("models:/tiny/1"))
    files = json.loads(tags["trainpipe.files"])
    weights = (served / "model" / "model.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == files["model.safetensors"]
    # the logged model: its run, its step, its validation loss; the run's datasets as MLflow inputs
    model = c.get_logged_model(p.model_id)
    assert model.source_run_id == v.run_id and model.status == "READY"
    # in the run's experiment, its files beside the run's (not ./mlruns of the working folder)
    assert model.experiment_id == c.get_run(v.run_id).info.experiment_id
    assert model.artifact_location.startswith(f"file://{trained['home']}/mlartifacts/")
    assert {m.key for m in model.metrics or []} >= {"validated/val_loss"}
    run = c.get_run(v.run_id)
    contexts = {t.value for d in run.inputs.dataset_inputs for t in d.tags if t.key == "mlflow.data.context"}
    assert contexts == {"training", "validation"}
    names = {d.dataset.name for d in run.inputs.dataset_inputs}
    assert names == {f"{tags['trainpipe.dataset_id']}/{split} (byte tokenizer)" for split in ("train", "val")}
    card = (served / "model_card.md").read_text()  # its card says what it is, and nothing was looked up on the Hub
    assert card.startswith("# tiny: run long") and validated["model_digest"] in card, card
    assert f"validation loss {validated['val_loss']:.4f}" in card
    requirements = (served / "requirements.txt").read_text().split()
    assert {r.split("==")[0] for r in requirements} >= {"torch", "transformers", "mlflow"} and all(
        "==" in r for r in requirements
    )


def test_champion_moves_only_on_losses_the_stage_recomputes(trained, publish):
    first = publish("long")
    # a registry user writes a flattering figure on the champion: the gate does not read it
    client(publish.uri).set_model_version_tag("tiny", "1", "trainpipe.val_loss", "99.0")
    worse = publish("short")
    assert worse.aliases == ["candidate"] and worse.gate.promoted is False
    assert worse.gate.champion_version == "1"
    assert worse.gate.champion_val_loss == pytest.approx(first.gate.candidate_val_loss, abs=1e-6)
    assert worse.gate.candidate_val_loss > worse.gate.champion_val_loss
    assert worse.gate.line.startswith(f"kept: val loss {worse.gate.candidate_val_loss:.4f} against champion v1's")
    registry = Registry(publish.uri)
    assert (
        str(registry.by_alias("tiny", "champion").version) == "1"
        and str(registry.by_alias("tiny", "candidate").version) == "2"
    )
    # the profile's own threshold: the operator accepts the short run
    accepted = publish("short", "publish.gate_max_val_loss=10")
    assert accepted.reused and accepted.version == "2"  # this run published these weights already: no new version
    threshold = publish("short", "publish.gate_tolerance=5", "publish.registered_model=tolerant")
    assert threshold.aliases == ["candidate", "champion"]  # a model of its own: no champion yet


def test_a_champion_on_another_tokenizer_does_not_compare(trained, publish):
    publish("long")
    other = publish("bpe")
    assert not other.gate.promoted and other.gate.champion_val_loss is None
    assert other.gate.line == "kept: champion v1 has another tokenizer: val losses do not compare"
    assert publish("bpe", "publish.gate_max_val_loss=100").gate.line.startswith("kept")  # reused: as decided then


def test_a_registry_that_does_not_answer_is_one_line_without_its_password(trained, publish, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    before = catalog.inspect_checkpoint(trained["long"]["uri"]).manifest
    with pytest.raises(PublishError) as err:
        publish("long", tracking_uri=f"http://ops:hunter2-secret@127.0.0.1:{free_port()}")
    line = str(err.value)
    assert line.startswith("the model registry at http://<redacted>@127.0.0.1:")
    assert "refused to read registered model 'tiny'" in line
    assert "hunter2" not in line and "\n" not in line
    assert catalog.inspect_checkpoint(trained["long"]["uri"]).manifest == before


def test_publishing_without_tracking_is_one_line(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPIPE_HOME", str(trained["home"]))
    prof = load_profile("local", [*TINY, "tracking.enabled=false"])
    with pytest.raises(PublishError, match=r"publishing needs MLflow tracking: set tracking\.enabled: true"):
        publish_checkpoint(prof, "long", None, trained["long"], tmp_path)


@pytest.mark.parametrize(
    "overridable, override",
    [
        (["default"], "publish.registered_model=someone-elses-model"),
        (["default", "publish.*"], "publish.registered_model=someone-elses-model"),
        (["default", "publish.*"], "publish.gate_tolerance=100"),
        (["default", "publish.*"], "publish.enabled=false"),
    ],
)
def test_a_run_form_may_not_choose_the_registered_model_or_the_gate(home, overridable, override):
    """The registry is shared: which model a run's versions join and when its champion moves are the operator's,
    and ``publish.*`` in deploy.overridable does not hand them to a form (only the exact key does)."""
    prof = load_profile("local", [f"deploy.overridable={json.dumps(overridable)}"])
    with pytest.raises(ProfileError, match=re.escape(f"{override.split('=')[0]} cannot be set from the run form")):
        check_form_overrides(prof, [override])


def test_logging_through_mlflows_fluent_api_leaves_no_uri_behind(monkeypatch, tmp_path):
    """``fluent`` puts mlflow's process-wide URIs and their environment variables back as they were: a resolved
    default written back sent later clients (and every subprocess) to ./mlflow.db of the working folder."""
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    from trainpipe.trainer.orchestrate.registry import fluent

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    monkeypatch.setattr(tracking_utils, "_tracking_uri", None)
    monkeypatch.setattr(registry_utils, "_registry_uri", None)
    with fluent(f"sqlite:///{tmp_path}/x.db"):
        assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path}/x.db"
    assert "MLFLOW_TRACKING_URI" not in os.environ and "MLFLOW_REGISTRY_URI" not in os.environ
    assert tracking_utils._tracking_uri is None and registry_utils._registry_uri is None


def test_models_list_and_promote_from_the_cli(trained, publish, cli):
    publish("long")
    publish("short")
    store = [f"--set=tracking.tracking_uri={publish.uri}", "--set=tracking.experiment=tiny"]
    code, out, err = cli("models", "list", *store)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("tiny v2    candidate ") and " run short " in lines[0]
    assert lines[1].startswith("tiny v1    champion ") and " run long " in lines[1]
    code, out, err = cli("models", "promote", "2", *store)  # the gate, recomputed: v2 is worse
    assert code == 1 and out.startswith("tiny version 2: kept: val loss ") and "against champion v1's" in out
    code, out, err = cli("models", "promote", "2", "--force", *store)
    assert code == 0 and out.strip() == "tiny version 2: promoted by hand (trainpipe models promote --force)"
    code, out, err = cli("models", "list", "--json", *store)
    assert [(v["version"], v["aliases"]) for v in json.loads(out.splitlines()[-1])] == [
        ("2", ["candidate", "champion"]),
        ("1", []),
    ]
    code, out, err = cli("models", "promote", "1", *store)  # back: the gate passes for the better one
    assert code == 0 and "promoted: val loss" in out
    code, out, err = cli("models", "list", "--set=publish.registered_model=nobody", *store)
    assert code == 2
    assert err.strip() == "error: registered model 'nobody' has no versions yet; a run of this profile publishes one"
