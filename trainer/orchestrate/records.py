"""A run's records in the store (``trainer.layout.RunPaths``): incidents, attempts, excluded nodes.

One writer per run (the task that runs it); object stores cannot append, so each
small list is rewritten whole, atomically.
"""

from __future__ import annotations

from trainer.config import StoreConfig
from trainer.incidents import AttemptRecord, Incident
from trainer.layout import RunPaths
from trainer.store import read_json_uri, write_json_uri


class RunRecords:
    def __init__(self, store: StoreConfig, run_name: str):
        self.paths, self.so = RunPaths(store.root, run_name), store.storage_options

    def incidents(self) -> list[Incident]:
        return [Incident.model_validate(r) for r in read_json_uri(self.paths.incidents, self.so, [])]

    def add_incidents(self, *incidents: Incident) -> None:
        body = [i.model_dump(mode="json") for i in [*self.incidents(), *incidents]]
        write_json_uri(self.paths.incidents, self.so, body)

    def attempts(self) -> list[AttemptRecord]:
        return [AttemptRecord.model_validate(r) for r in read_json_uri(self.paths.attempts, self.so, [])]

    def add_attempt(self, record: AttemptRecord) -> None:
        write_json_uri(self.paths.attempts, self.so, [r.model_dump(mode="json") for r in [*self.attempts(), record]])

    def excluded_nodes(self) -> list[str]:
        return list(read_json_uri(self.paths.excluded_nodes, self.so, []))

    def exclude_node(self, node: str) -> None:
        """Remember a node the run must not use again (a straggler under on_straggler: exclude)."""
        nodes = self.excluded_nodes()
        if node not in nodes:
            write_json_uri(self.paths.excluded_nodes, self.so, [*nodes, node])
