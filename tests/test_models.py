"""Model plug-ins: a factory named in the profile builds the model training, validation and resume use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY
from trainpipe.trainer.checkpoint.validate import validate_checkpoint
from trainpipe.trainer.config import ModelConfig
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.errors import ProfileError
from trainpipe.trainer.factory import build_model, check_model, model_loss
from trainpipe.trainer.profile_files import PROFILES_DIR, load_profile
from trainpipe.trainer.store_paths import RunPaths
from trainpipe.trainer.supervise.attempt import train_attempt

pytestmark = pytest.mark.usefixtures("warm_module")

USER_MODEL = ["model.factory=tests.user_model:bigram", "model.config={width: 16}"]
LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


def cfg(factory: str, **config) -> ModelConfig:
    return ModelConfig(factory=factory, config=config, block_size=16)


@pytest.mark.parametrize(
    "factory, config, message",
    [
        ("no_such_package.models:gpt", {}, "cannot import no_such_package.models"),
        ("tests.user_model:nothing", {}, "tests.user_model has no nothing"),
        ("tests.user_model:unmarked", {}, "is not a model factory: decorate it with @model_factory"),
        ("os:getcwd", {}, "os:getcwd is not a model factory"),
        ("tests.user_model:broken", {}, "tests.user_model:broken failed: ValueError: width must be even"),
        ("tests.user_model:not_a_module", {}, "returned dict, not a torch.nn.Module"),
        ("trainpipe.trainer.hf:causal_lm", {}, "model.config.model_type is missing"),
        ("trainpipe.trainer.hf:causal_lm", {**LLAMA, "vocab_size": 1000}, "differs from model.vocab_size 256"),
        (
            "trainpipe.trainer.hf:causal_lm",
            {**LLAMA, "max_position_embeddings": 8},
            "max_position_embeddings 8 is below",
        ),
        (
            "trainpipe.trainer.hf:causal_lm",
            {"model_type": "no-such-architecture"},
            "model.config: not a transformers config",
        ),
    ],
)
def test_a_factory_that_cannot_build_a_model_is_one_line(factory, config, message):
    with pytest.raises(ProfileError, match=message) as err:
        build_model(cfg(factory, **config))
    assert "\n" not in str(err.value)


def test_a_profile_cannot_name_a_factory_that_is_not_an_import_path():
    with pytest.raises(ProfileError, match=r"model\.factory"):
        load_profile("local", ["model.factory=os.system('x')"])


@pytest.mark.parametrize(
    "factory, config",
    [
        ("trainpipe.trainer.model:gpt", {}),
        ("tests.user_model:bigram", {"width": 8}),
        ("trainpipe.trainer.hf:causal_lm", LLAMA),
        ("trainpipe.trainer.hf:causal_lm", {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2}),
    ],
)
def test_every_factory_follows_the_protocol(factory, config):
    torch.manual_seed(0)
    model = build_model(cfg(factory, **config))
    x = torch.randint(0, 256, (2, 16))
    loss = model_loss(model(x, x.roll(-1, dims=1)), factory)
    assert loss.shape == () and torch.isfinite(loss)
    torch.manual_seed(0)
    again = build_model(cfg(factory, **config))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))


def test_model_loss_refuses_what_the_protocol_does_not_allow():
    with pytest.raises(ProfileError, match="not a scalar loss"):
        model_loss(torch.zeros(3), "m")


def test_a_run_with_a_factory_that_cannot_build_is_one_line_before_anything_starts(home, cli):
    for factory, expected in [
        ("tests.user_model:broken", "tests.user_model:broken failed: ValueError: width must be even"),
        ("tests.user_model:not_a_module", "returned dict, not a torch.nn.Module"),
        ("tests.user_model:unmarked", "is not a model factory"),
        ("no_such_package.models:gpt", "cannot import no_such_package.models"),
    ]:
        code, _, err = cli("run", "-p", "local", "--set", f"model.factory={factory}")
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
    assert not (home / "store" / "runs").exists()
    check_model(cfg("tests.user_model:reads_its_weights"))  # fails on the meta device only: not refused


LLAMA_BPE = [  # llama-tiny's combination: a transformers Llama on a bpe tokenizer trained at shard time
    "model.factory=trainpipe.trainer.hf:causal_lm",
    f"model.config={json.dumps(LLAMA)}",  # JSON is YAML
    "data.tokenizer=bpe",
    "data.vocab_size=512",
    "model.vocab_size=512",
]


@pytest.mark.distributed
@pytest.mark.parametrize("model", [USER_MODEL, LLAMA_BPE], ids=["user-model", "transformers-llama-bpe"])
def test_a_plugged_in_model_trains_under_torchrun_and_validates(home, model):
    """A factory in the user's own module (tests/user_model.py) or transformers', imported by the ranks and by
    validation, which learns the model from the checkpoint alone."""
    prof = load_profile("local", [*TINY, "tracking.enabled=false", *model])
    run = train_attempt(prof, "mine", shard_dataset(prof.data, prof.store).uri)
    assert run.result is not None, "\n".join(run.job.tail)
    assert not Path(RunPaths(prof.store.root, "mine").profile).exists()  # only the checkpoint records the model
    # the caller names the factory it trusts: a recorded one outside trainpipe is imported only when it matches
    report = validate_checkpoint(
        RunPaths(prof.store.root, "mine").checkpoint(8), load_profile("local", [*TINY, *model])
    )
    assert report["model_digest"] == run.result.model_digest


@pytest.mark.distributed
def test_a_plugged_in_model_resumes_after_a_sigkill_to_the_same_weights(home):
    prof = load_profile("local", [*TINY, "tracking.enabled=false", *LLAMA_BPE])
    dataset = shard_dataset(prof.data, prof.store).uri
    reference = train_attempt(prof, "reference", dataset)
    assert reference.result is not None, "\n".join(reference.job.tail)
    # SIGKILL at step 6, after the (synchronous here: these steps take milliseconds) commit of step 4
    crash = ["faults.kind=crash", "faults.rank=1", "faults.step=6", "checkpoint.async=false"]
    killed = train_attempt(load_profile("local", [*TINY, "tracking.enabled=false", *LLAMA_BPE, *crash]), "r", dataset)
    assert killed.result is None and killed.incident.kind == "crash" and killed.incident.rank == 1, killed.incident
    resumed = train_attempt(prof, "r", dataset)
    assert resumed.result is not None, "\n".join(resumed.job.tail)
    assert resumed.result.start_step == 4
    assert resumed.result.model_digest == reference.result.model_digest


@pytest.mark.parametrize("profile", sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
def test_every_shipped_profile_loads_and_builds_its_model(home, profile):
    prof = load_profile(profile)
    check_model(prof.model)
    model = build_model(prof.model)
    logits, loss = model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    assert logits.shape == (1, 8, prof.model.vocab_size) and loss.ndim == 0
    # and ends by publishing a model of a stock architecture (docs/architecture.md §11)
    assert prof.publish.enabled and prof.tracking.enabled
    from trainpipe.trainer.export.architectures import export_spec
    from trainpipe.trainer.export.safetensors_out import TensorSpec

    weights = {name: TensorSpec(t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()}
    assert export_spec(prof.model, weights).tensors
