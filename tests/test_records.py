"""A run's records in the store (trainer/orchestrate/records.py): round trip, earlier formats, damaged files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainpipe.trainer.config import StoreConfig
from trainpipe.trainer.incidents import AttemptRecord, Incident
from trainpipe.trainer.orchestrate.records import RunRecords


@pytest.fixture
def records(tmp_path) -> RunRecords:
    return RunRecords(StoreConfig(root=str(tmp_path / "store")), "r")


def test_records_round_trip_in_order(records):
    assert records.incidents() == [] and records.attempts() == [] and records.excluded_nodes() == []
    first, second = Incident(kind="crash", detail="a", rank=1), Incident(kind="hang", detail="b", rank=0)
    records.add_incidents(first)
    records.add_incidents(second)
    assert records.incidents() == [first, second]
    records.add_attempt(AttemptRecord(attempt=1, start_step=0, incident=first))
    assert records.attempts()[0].incident == first
    records.exclude_node("n1")
    records.exclude_node("n1")
    assert records.excluded_nodes() == ["n1"]


def test_an_incident_written_by_the_earlier_format_still_reads(records):
    earlier = {
        "kind": "crash",
        "rank": 1,
        "node": "vm",
        "step": 30,
        "phase": "forward",
        "detected_after_s": 0.8,
        "detail": "rank 1 killed by SIGKILL",
        "attempt": 1,
        "time_epoch": 1796000000.5,
        "last_step": 31,
        "start_step": 0,
        "first_step_at": 1795999990.0,
        "progress": [{"rank": 0}],
        "time": "2026-11-30T09:00:00",
    }
    path = Path(records.paths.incidents)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps([earlier]))
    [incident] = records.incidents()
    assert (incident.kind, incident.rank, incident.at, incident.time) == (
        "crash",
        1,
        1796000000.5,
        "2026-11-30T09:00:00",
    )


@pytest.mark.parametrize("body", ["{not json", '{"kind": "crash"}', '[{"kind": "meteor", "detail": "x"}]'])
def test_a_damaged_record_file_is_moved_aside_with_a_warning_and_the_run_goes_on(records, body, caplog):
    path = Path(records.paths.incidents)
    path.parent.mkdir(parents=True)
    path.write_text(body)
    assert records.incidents() == []
    [aside] = path.parent.glob("incidents.json.corrupt-*")
    assert aside.read_text() == body and not path.exists()
    assert "incidents.json was not a list of Incident records" in caplog.text and aside.name in caplog.text
    records.add_incidents(Incident(kind="crash", detail="after", rank=0))  # the run records on
    assert [i.detail for i in records.incidents()] == ["after"]
