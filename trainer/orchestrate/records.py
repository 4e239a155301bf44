"""A run's records in the store (``trainer.store_paths.RunPaths``): incidents, attempts, excluded nodes.

One writer per run (the task that runs it); object stores cannot append, so each
small list is rewritten whole, atomically.
"""

from __future__ import annotations

import logging
import time
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from trainpipe.trainer import grammar
from trainpipe.trainer.config import MAX_STEP, StoreConfig
from trainpipe.trainer.errors import StoreError
from trainpipe.trainer.incidents import AttemptRecord, Incident
from trainpipe.trainer.store import NotARecord, filesystem, move, read_json_uri, write_json_uri
from trainpipe.trainer.store_paths import RunPaths

Record = TypeVar("Record", bound=BaseModel)
MAX_ROLLBACKS = 32  # a run that spiked this often has a problem no skipped data solves: the policy stops first
log = logging.getLogger("trainpipe.records")


def read_records(uri: str, storage_options: dict, model: type[Record]) -> list[Record]:
    """The list of records at ``uri`` (none when the file is absent).

    A file that is not such a list (a hand edit, a foreign writer) is moved aside to ``{uri}.corrupt-{time}``
    with a warning, and the run goes on with no records: losing the history of past incidents costs less
    than a run that can no longer start. StoreError naming the file when it cannot be moved.
    """
    try:
        body = read_json_uri(uri, storage_options, [])
        if not isinstance(body, list):
            raise ValueError("not a JSON list")
        return [model.model_validate(r) for r in body]
    except (ValueError, ValidationError, UnicodeDecodeError, NotARecord) as exc:  # JSONDecodeError: a ValueError
        first = str(exc).splitlines()[0][:200]
        aside = f"{uri}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
        try:
            fs, path = filesystem(uri, storage_options)
            move(fs, path, filesystem(aside, storage_options)[1])
        except OSError as failed:
            raise StoreError(
                f"{uri} is not a list of {model.__name__} records ({first}) and cannot be moved aside "
                f"({failed.__class__.__name__}); move it aside to go on"
            ) from None
        log.warning("%s was not a list of %s records (%s): moved aside to %s", uri, model.__name__, first, aside)
        return []


class RunRecords:
    def __init__(self, store: StoreConfig, run_name: str):
        self.paths, self.so = RunPaths(store.root, run_name), store.storage_options

    def incidents(self) -> list[Incident]:
        return read_records(self.paths.incidents, self.so, Incident)

    def add_incidents(self, *incidents: Incident) -> None:
        body = [i.model_dump(mode="json") for i in [*self.incidents(), *incidents]]
        write_json_uri(self.paths.incidents, self.so, body)

    def attempts(self) -> list[AttemptRecord]:
        return read_records(self.paths.attempts, self.so, AttemptRecord)

    def add_attempt(self, record: AttemptRecord) -> None:
        write_json_uri(self.paths.attempts, self.so, [r.model_dump(mode="json") for r in [*self.attempts(), record]])

    def excluded_nodes(self) -> list[str]:
        # The store is not trusted (docs/security.md): these names go into a job script and a node affinity.
        nodes = read_json_uri(self.paths.excluded_nodes, self.so, [])
        if not isinstance(nodes, list) or not all(grammar.matches(grammar.NODE_NAME, n) for n in nodes):
            raise StoreError(f"{self.paths.excluded_nodes} is not a list of node names; move it aside to go on")
        return nodes

    def exclude_node(self, node: str) -> None:
        """Remember a node the run must not use again (a straggler under on_straggler: exclude). A name that is
        not a node's (it came from a host's report, which a cluster's store may have had planted) is not kept."""
        if not grammar.matches(grammar.NODE_NAME, node):
            log.warning("not excluding %r: not a node's name", node)
            return
        nodes = self.excluded_nodes()
        if node not in nodes:
            write_json_uri(self.paths.excluded_nodes, self.so, [*nodes, node])

    def rollbacks(self) -> list[int]:
        """Steps of the loss spikes the run rolls back from (``train.rollbacks``)."""
        try:
            steps = read_json_uri(self.paths.rollbacks, self.so, [])
        except ValueError:  # not JSON, or a number of thousands of digits
            steps = None
        if not isinstance(steps, list) or len(steps) > MAX_ROLLBACKS:
            steps = None
        if steps is None or not all(type(s) is int and 1 <= s <= MAX_STEP for s in steps):
            raise StoreError(
                f"{self.paths.rollbacks} is not a list of at most {MAX_ROLLBACKS} steps; move it aside to go on"
            )
        return steps

    def roll_back(self, step: int) -> None:
        """Remember a loss spike the run rolls back from: every later attempt resumes before it (or from a
        checkpoint that already skipped its data)."""
        steps = self.rollbacks()
        if step not in steps:
            write_json_uri(self.paths.rollbacks, self.so, [*steps, step])

    def save_flight_recorders(self, attempt: int, dumps: dict[int, Any]) -> str:
        """Each rank's flight recorder after a hang, kept with the run; returns their folder."""
        folder = self.paths.diagnostics(attempt)
        for rank, dump in sorted(dumps.items()):
            write_json_uri(f"{folder}/flight-rank{rank}.json", self.so, dump)
        return folder
