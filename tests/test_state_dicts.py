"""The renamed native state dicts (trainer.loop.state_dicts) against get_state_dict's own, in-process."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.nn.parallel import DistributedDataParallel

from trainpipe.trainer.config import ModelConfig
from trainpipe.trainer.loop.state_dicts import PlainStateDicts, _same
from trainpipe.trainer.model import gpt

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=False)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randint(0, 256, (2, 16))
    out = model(x, x)
    (out[1] if isinstance(out, tuple) else out).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture(scope="module")
def one_rank():
    """A world of one rank in this process (DDP wraps a model only in an initialised one); gone after the module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def _ddp_gpt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = DistributedDataParallel(gpt(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.usefixtures("one_rank")
def test_a_ddp_gpts_state_dicts_are_get_state_dicts_learned_once_and_follow_training():
    model, optimizer = _ddp_gpt()  # a tied embedding: two model keys, one optimizer entry
    plain = PlainStateDicts()
    _step(model, optimizer)
    for _ in range(3):
        got = plain.get(model, optimizer)
        assert _same(got, get_state_dict(model, optimizer, options=OPTIONS))
        _step(model, optimizer)
    assert plain.renamed and plain.learned == 1
    model_sd, optim_sd = plain.get(model, optimizer)
    assert "module.wte.weight" not in model_sd and "wte.weight" in model_sd
    assert optim_sd["param_groups"][0]["params"][0] == "wte.weight"
    assert torch.equal(model_sd["wte.weight"], model.module.wte.weight)  # the live tensors, not a copy


@pytest.mark.usefixtures("one_rank")
def test_a_new_optimizer_state_entry_or_a_new_optimizer_is_learned_again():
    model, optimizer = _ddp_gpt()
    plain = PlainStateDicts()
    assert _same(plain.get(model, optimizer), get_state_dict(model, optimizer, options=OPTIONS))  # no state yet
    _step(model, optimizer)  # AdamW's state appears
    assert _same(plain.get(model, optimizer), get_state_dict(model, optimizer, options=OPTIONS))
    assert plain.learned == 2
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, fresh)
    assert _same(plain.get(model, fresh), get_state_dict(model, fresh, options=OPTIONS))
    assert plain.learned == 3


class _Named(torch.nn.Module):
    """A plain module whose first child is called ``module``: its keys are not DDP's, and get_state_dict keeps
    them whole, so stripping the prefix would name them wrongly."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(4, 4)


def test_names_that_are_no_renaming_fall_back_to_get_state_dict_each_time():
    model = _Named()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.module(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    plain = PlainStateDicts()
    for _ in range(2):
        model_sd, _ = plain.get(model, optimizer)
        assert "module.weight" in model_sd
    assert not plain.renamed and plain.learned == 1


def test_same_tells_a_copy_a_key_or_a_value_apart():
    t = torch.arange(4.0)
    assert _same({"a": t, "b": [1, (2, "x")]}, {"a": t.detach(), "b": [1, (2, "x")]})
    assert not _same({"a": t}, {"a": t.clone()})  # another storage
    assert not _same({"a": t}, {"b": t})
    assert not _same({"a": [1, 2]}, {"a": (1, 2)})
    assert not _same({"a": 1}, {"a": 1.0})
    assert not _same({"a": t}, {"a": t[:2]})
