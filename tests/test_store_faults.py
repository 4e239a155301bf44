"""The object store misbehaving, for real: moto_server behind a proxy that refuses, resets or answers 503."""

from __future__ import annotations

import errno
import logging
import re
import threading
import time

import pytest

from tests.fault_proxy import FaultProxy
from trainpipe.trainer import store_retry
from trainpipe.trainer.errors import StoreUnavailable
from trainpipe.trainer.store import filesystem, read_json, write_json

pytestmark = pytest.mark.usefixtures("warm_module")  # its attempts fork their agents (conftest)


@pytest.fixture
def faulty_store(s3_endpoint, s3_bucket, monkeypatch):
    """(proxy, store root through it, its storage options): a bucket on moto_server reached through a FaultProxy."""
    import s3fs

    bucket, _ = s3_bucket
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retry loop: one try, so ours is measured
    with FaultProxy(int(s3_endpoint.rsplit(":", 1)[1])) as proxy:
        options = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing", "skip_instance_cache": True}
        yield proxy, f"s3://{bucket}/store", options


def test_what_is_transient():
    from botocore.exceptions import ClientError, EndpointConnectionError

    throttled = OSError(errno.EIO, "SlowDown")
    throttled.__cause__ = ClientError({"Error": {"Code": "X"}, "ResponseMetadata": {"HTTPStatusCode": 429}}, "Put")
    denied = OSError(errno.EIO, "no")
    denied.__cause__ = ClientError({"Error": {"Code": "X"}, "ResponseMetadata": {"HTTPStatusCode": 400}}, "Put")
    transient = [
        EndpointConnectionError(endpoint_url="http://x"),
        ConnectionResetError(),
        TimeoutError(),
        OSError(errno.EBUSY, "503"),
        OSError(errno.EREMOTEIO, "500"),
        throttled,
    ]
    permanent = [FileNotFoundError("k"), PermissionError("denied"), OSError(errno.EINVAL, "bad digest"), denied]
    assert [store_retry.is_transient(e) for e in transient] == [True] * len(transient)
    assert [store_retry.is_transient(e) for e in permanent] == [False] * len(permanent)


def test_a_transient_outage_is_retried_until_the_store_is_back_and_said_when_it_starts_and_ends(faulty_store, caplog):
    """Each kind of outage: the read succeeds once the store is back; a person reads one line when it starts
    (naming the request) and one when it ends, and each retry only at DEBUG."""
    proxy, root, options = faulty_store
    fs, base = filesystem(root, options)
    write_json(fs, f"{base}/a.json", {"x": 1})
    for mode in ("503", "reset", "refuse"):
        proxy.mode = mode
        threading.Timer(0.7, lambda: setattr(proxy, "mode", "pass")).start()
        caplog.clear()
        with caplog.at_level(logging.DEBUG, "trainpipe.store"):
            assert read_json(fs, f"{base}/a.json") == {"x": 1}
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        retries = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "retry" in r.getMessage()]
        # a record is read as a checkpoint file is: its size first (info), then its bytes (one ranged read)
        named = [f"{call} s3://{base}/a.json failed" for call in ("info", "reading")]
        assert len(said) == 2 and said[0].startswith("store unreachable: "), (mode, said)
        assert any(n in said[0] for n in named) and said[1].startswith("store back after "), (mode, said)
        assert f"retried {len(retries)} time(s)" in said[1] and "retry 1 in" in retries[0], (mode, said, retries)


def test_a_long_outage_is_said_again_while_it_lasts_and_every_request_counts():
    """In-process, in milliseconds: two requests fail through one outage; it is said when it starts, again each
    ``every_s`` while it lasts, and once when a request gets through, with the requests and retries it cost."""
    outage, back_at, tries = store_retry.Outage(every_s=0.05), time.monotonic() + 0.25, []

    def flaky(name: str) -> str:
        tries.append(name)
        if time.monotonic() < back_at:
            time.sleep(0.01)
            raise ConnectionResetError("reset by peer")
        return name

    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    store_log = logging.getLogger("trainpipe.store")
    store_log.addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(store_retry, "_outage", outage)
            m.setattr(store_retry, "_policy", store_retry.RetryPolicy(budget_s=5, base_s=0.001, cap_s=0.002))
            threads = [threading.Thread(target=store_retry.call, args=(f"get {n}", flaky, n)) for n in "ab"]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        store_log.removeHandler(handler)
    retried = len(tries) - 2  # each request's last try got through
    assert lines[0].startswith("store unreachable: get ") and "ConnectionResetError: reset by peer" in lines[0]
    middle = lines[1:-1]
    assert 1 <= len(middle) <= 10 and all(line.startswith("store still unreachable after ") for line in middle)
    said = re.fullmatch(r"store back after 0s: 2 request\(s\) retried (\d+) time\(s\)", lines[-1])
    # the other request's try in flight as the first got through failed after the end: no outage of its own
    assert said and retried - 1 <= int(said.group(1)) <= retried, (lines[-1], retried)


def test_an_outage_every_request_gave_up_on_is_said_to_end_so(monkeypatch, caplog):
    """The store never comes back within the budget: the request raises StoreUnavailable, and the outage's last
    line says it gave up (so that the next outage, much later, starts afresh)."""
    monkeypatch.setattr(store_retry, "_outage", store_retry.Outage())
    monkeypatch.setattr(store_retry, "_policy", store_retry.RetryPolicy(budget_s=0.05, base_s=0.001, cap_s=0.002))

    def down() -> None:
        raise ConnectionRefusedError("refused")

    with caplog.at_level(logging.WARNING, "trainpipe.store"), pytest.raises(StoreUnavailable):
        store_retry.call("put x", down)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("store unreachable: put x failed (ConnectionRefusedError")
    assert said[1].startswith("store: gave up after 0s: 1 request(s) retried "), said
    caplog.clear()
    with caplog.at_level(logging.WARNING, "trainpipe.store"), pytest.raises(StoreUnavailable):
        store_retry.call("put y", down)
    assert caplog.records[0].getMessage().startswith("store unreachable: put y failed")


def test_a_request_whose_one_try_outlasts_the_budget_is_said_as_an_outage_that_gave_up(monkeypatch, caplog):
    """On a loaded host (or a store that holds the connection), the first try itself may fail only after the
    whole budget: the request raises StoreUnavailable without a retry, and is still one line naming the outage
    (never none), unless an outage already said counts it."""
    monkeypatch.setattr(store_retry, "_outage", store_retry.Outage())
    monkeypatch.setattr(store_retry, "_policy", store_retry.RetryPolicy(budget_s=0.05, base_s=0.001, cap_s=0.002))

    def slow_then_down() -> None:
        time.sleep(0.08)
        raise ConnectionResetError("reset by peer")

    with caplog.at_level(logging.WARNING, "trainpipe.store"), pytest.raises(StoreUnavailable):
        store_retry.call("pipe_file s3://b/step-20/x", slow_then_down)
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("store unreachable: pipe_file s3://b/step-20/x failed after 0.1s (ConnectionResetError")
    assert said.endswith("gave up: its one try outlasted the 0.05s retry budget"), said


def test_a_permanent_error_raises_at_once_and_an_outage_past_the_budget_is_store_unavailable(
    faulty_store, monkeypatch, caplog
):
    proxy, root, options = faulty_store
    fs, base = filesystem(root, options)
    monkeypatch.setattr(store_retry, "_policy", store_retry.RetryPolicy(budget_s=2.0))
    with caplog.at_level(logging.WARNING, "trainpipe.store"), pytest.raises(FileNotFoundError):
        fs.cat_file(f"{base}/missing.json")
    assert not caplog.records  # not retried
    proxy.mode = "reset"
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=rf"store unavailable: pipe_file s3://{base}/b.json failed for \d+s"):
        write_json(fs, f"{base}/b.json", {"y": 2})
    assert time.monotonic() - t0 < 2.0 + 6  # the budget, plus at most one try's connect timeout


def test_an_outage_during_an_upload_or_a_resume_costs_no_weights(
    s3_endpoint, s3_bucket, home, monkeypatch, drill_digest
):
    """The DRILL run on S3 through the proxy, with every request for step 20's folder reset until its upload
    gives up (store.retry_s=2): the loop never queues behind it (the saves meanwhile are skipped), the failure
    and the outage are incidents, step 10 stays committed, and the final weights are the fault-free run's.
    Then, its final commit lost, a retry of the run while its checkpoints cannot be read fails as a retryable
    StoreUnavailable, and the next one, with the store back, resumes mid-run from S3 to the same weights."""
    import s3fs

    from tests.conftest import DRILL
    from trainpipe.trainer.checkpoint.catalog import list_checkpoints
    from trainpipe.trainer.data.shard import shard_dataset
    from trainpipe.trainer.orchestrate.policy import after_attempt
    from trainpipe.trainer.profile_files import load_profile
    from trainpipe.trainer.store_paths import RunPaths
    from trainpipe.trainer.supervise.attempt import train_attempt

    bucket, options = s3_bucket
    with FaultProxy(int(s3_endpoint.rsplit(":", 1)[1])) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)  # the ranks reach the store through the proxy
        on_s3 = [f"store.root=s3://{bucket}/tp", "store.retry_s=2", "checkpoint.keep_last=5"]
        prof = load_profile("local", [*DRILL, "faults.kind=none", "tracking.enabled=false", *on_s3])
        dataset_uri = shard_dataset(prof.data, prof.store).uri
        lines: list[str] = []

        def on_line(line: str) -> None:
            lines.append(line)
            if "checkpoint_failed" in line:
                proxy.fail_matching = None  # the store is back

        proxy.fail_matching = "step-00000020"
        run = train_attempt(prof, "outage", dataset_uri, on_line=on_line)
    assert run.result is not None, "\n".join(run.job.tail)
    assert run.result.model_digest == drill_digest
    failed = [f for f in run.findings if f.kind == "checkpoint_failed"]
    assert [(f.step, f.fatal) for f in failed] == [(20, False)], run.findings
    assert "StoreUnavailable" in failed[0].detail and "step 10 stays the newest" in failed[0].detail
    outage = [f for f in run.findings if f.kind == "store_outage"]
    assert len(outage) == 1 and outage[0].step == 20 and "skipped meanwhile (step 30" in outage[0].detail
    # store.retry_s, then one last try; the clock starts before DCP plans the save across the ranks, which a
    # loaded CI host stretches (4.1 s seen). The bound tells the 2 s budget from the profile's default 120 s.
    assert 2 <= outage[0].detected_after_s <= 2 + 4
    said = [line for line in lines if "store unreachable: " in line or "store: gave up after " in line]
    assert said, "no outage line in the job's output; its last lines:\n" + "\n".join(lines[-60:])
    # not a line per retry: it started, and it gave up (at once, when a loaded host's one try outlasted the budget)
    assert "step-00000020" in said[0] and "gave up" in said[-1] and len(said) < 10, said[:20]
    steps = {i.step: i.valid for i in list_checkpoints(RunPaths(prof.store.root, "outage").checkpoints, options)}
    assert steps[10] and steps[60] and not steps.get(20) and 30 not in steps
    assert max(run.result.checkpoint_stalls_s) < 3  # never the 4 s the failing upload took

    # The final commit lost (its manifest deleted): the retry resumes mid-run, from S3.
    ckpts = RunPaths(prof.store.root, "outage").checkpoints
    s3 = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    s3.rm_file(f"{ckpts.removeprefix('s3://')}/step-00000060/trainpipe.json")
    resume_at = max(step for step, valid in steps.items() if valid and step < 60)

    # A retry while every checkpoint request fails: a rank's StoreUnavailable, which the policy retries.
    with FaultProxy(int(s3_endpoint.rsplit(":", 1)[1])) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        impatient = load_profile(
            "local", [*DRILL, "faults.kind=none", "tracking.enabled=false", *on_s3, "store.retry_s=1"]
        )
        proxy.fail_matching = "checkpoints"
        failed_resume = train_attempt(impatient, "outage", dataset_uri, attempt=2)
        assert failed_resume.result is None
        why = failed_resume.incident
        assert (why.kind, why.error, why.rank) == ("error", "StoreUnavailable", 0), why
        assert after_attempt(why, [], impatient).action == "retry"
        proxy.fail_matching = None
        resumed = train_attempt(impatient, "outage", dataset_uri, attempt=3)
    assert resumed.result is not None, "\n".join(resumed.job.tail)
    assert resumed.result.start_step == resume_at and resumed.result.final_step == 60
    assert resumed.result.model_digest == drill_digest  # hashed from the weights trained after the resume


def test_a_large_checkpoint_file_goes_up_in_parts_each_retried_and_a_failed_upload_leaves_nothing(
    faulty_store, monkeypatch
):
    import hashlib
    import os

    import s3fs

    from trainpipe.trainer.checkpoint import storage

    proxy, root, options = faulty_store
    monkeypatch.setattr(storage, "PART_BYTES", 5 << 20)  # S3's smallest part
    files = storage.StoreFiles()
    files.init_path(f"{root}/ck", **options)
    data = os.urandom(11 << 20)
    proxy.fail_matching = "partNumber=2"  # one part fails, then the store is back
    threading.Timer(0.7, lambda: setattr(proxy, "fail_matching", None)).start()
    requests = proxy.requests
    with files.create_stream(f"{root}/ck/a.distcp", "wb") as stream:
        stream.write(data[: 7 << 20])
        stream.write(memoryview(data)[7 << 20 :])
    assert proxy.requests - requests >= 5  # create, three parts (one of them again), complete
    fs = s3fs.S3FileSystem(**options)
    assert fs.cat_file(f"{root}/ck/a.distcp") == data
    assert files.written == {"a.distcp": hashlib.sha256(data).hexdigest()}

    monkeypatch.setattr(store_retry, "_policy", store_retry.RetryPolicy(budget_s=1.0))
    proxy.fail_matching = "partNumber=3"  # for good: the upload gives up, and is aborted
    with (
        pytest.raises(StoreUnavailable, match="uploading part 3 of"),
        files.create_stream(f"{root}/ck/b.distcp", "wb") as stream,
    ):
        stream.write(data)
    proxy.fail_matching = None
    assert not fs.exists(f"{root}/ck/b.distcp")
    bucket = root.removeprefix("s3://").split("/")[0]
    pending = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in pending] == [], pending


def test_a_source_the_store_cannot_serve_is_a_retryable_error_not_bad_data(faulty_store, monkeypatch):
    """Listing or reading data.source through a store answering 503: StoreUnavailable, which the shard stage
    retries, never a DataError, which would stop the run as bad input."""
    from trainpipe.trainer.config import DataConfig
    from trainpipe.trainer.data.shard import read_documents

    proxy, root, options = faulty_store
    fs, base = filesystem(root, options)
    fs.pipe_file(f"{base}/c.jsonl", b'{"text": "a document"}\n')
    data = DataConfig(source=f"{root}/c.jsonl")
    assert [t for _, t in read_documents(data, options)] == ["a document"]
    monkeypatch.setattr(store_retry, "_policy", store_retry.RetryPolicy(budget_s=0.5))
    proxy.mode = "503"
    with pytest.raises(StoreUnavailable, match=r"c\.jsonl.*(the store may be unreachable|once the store is back)"):
        list(read_documents(data, options))
    proxy.mode, proxy.fail_matching = "pass", "c.jsonl HTTP/"  # the listing answers, the file does not
    with pytest.raises(StoreUnavailable, match=r"c\.jsonl.*(the store may be unreachable|once the store is back)"):
        list(read_documents(data, options))
