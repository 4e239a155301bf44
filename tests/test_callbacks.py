"""The loop's event dispatcher (trainer/loop/callbacks.py): every event reaches every callback, in order."""

from __future__ import annotations

import inspect

from trainpipe.trainer.loop.callbacks import Callback, Callbacks

EVENTS = [name for name in vars(Callback) if name.startswith("on_")]


class Recorder(Callback):
    def __init__(self, name: str, seen: list):
        self.name, self.seen = name, seen

    def __getattribute__(self, attr: str):
        if attr in EVENTS:
            return lambda *args: self.seen.append((self.name, attr, args))
        return super().__getattribute__(attr)


def test_every_event_reaches_every_callback_in_order():
    seen: list = []
    dispatcher = Callbacks([Recorder("a", seen), Recorder("b", seen)])
    for event in EVENTS:
        n_args = len(inspect.signature(getattr(Callback, event)).parameters) - 1
        getattr(dispatcher, event)(*range(n_args))
    assert len(EVENTS) == 16
    assert seen == [
        (who, event, tuple(range(len(inspect.signature(getattr(Callback, event)).parameters) - 1)))
        for event in EVENTS
        for who in ("a", "b")
    ]
