"""Shard-stage throughput on each engine against the tokenizers library itself, in one run.

A corpus of the standard library's source is copied to a temporary folder (each copy of a file gets its own
first line, so no two documents are equal) and a BPE tokenizer.json is trained on it once. Then, in rounds
(interleaved, each measurement in a fresh process, medians reported):

- library, all cores: read every file and ``Tokenizer.encode_batch`` its text, ~1 MB a batch, with the
  library's own threads: the baseline every engine is held to;
- library, one thread: the same with ``TOKENIZERS_PARALLELISM=false``;
- in-process: the shard stage (``flows/shard.py: shard_corpus`` in a Prefect flow, against a Prefect server
  this script starts) with ``data.workers: 1``: its pieces in this process, the tokenizer on its own threads;
- pool: ``data.workers: 2``, Prefect's process pool, each worker's tokenizer on one thread;
- dask: ``data.engine`` a dask.distributed scheduler with two single-threaded workers this script starts;
- one worker, one thread: in-process with ``TOKENIZERS_PARALLELISM=false``: the per-worker rate;
- grown: the corpus sharded with ``data.workers`` unset (one process per core and per 32 MB of text to
  tokenize), then grown by 1% of its files (new names among the old) and sharded again into the same store
  (its files written more than ``sources.SETTLED_NS`` before the first shard, as a corpus that grows is).

Every shard run writes into an empty store, so nothing is reused (but in "grown"). Figures: MB/s of source text
(medians), and each ratio as the median over rounds of that round's ratio: each engine to the library on all
cores (target 0.9); pool over one worker on one thread (target 1.7), beside the library's own all cores over one
thread (the machine's ceiling for it); grown over a full shard (target 0.05). From the per-worker rate and the
store's write bandwidth (measured here on the local disk, or given with --store-mbps for an object store) it
projects the wall for a 100 GB corpus at 8, 64 and 512 workers.

    .venv/bin/python benchmarks/shard_throughput.py [--mb 24] [--rounds 3] [--vocab 8192] [--piece-mb 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

from trainpipe.trainer.data.sources import SETTLED_NS  # noqa: E402 - after the path

LIBRARY = r"""
import json, os, sys, time
from pathlib import Path
from tokenizers import Tokenizer
corpus, tokenizer = sys.argv[1], sys.argv[2]
tok = Tokenizer.from_file(tokenizer)
start = time.perf_counter()
batch, chars, tokens = [], 0, 0
for path in sorted(Path(corpus).rglob("*.py")):
    batch.append(path.read_text(encoding="utf-8", errors="replace"))
    chars += len(batch[-1])
    if chars >= 1 << 20:
        tokens += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
        batch, chars = [], 0
tokens += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
print(json.dumps({"wall_s": time.perf_counter() - start, "tokens": tokens}))
"""

ENGINE = r"""
import json, sys, time
from prefect import flow
from trainpipe.flows.shard import shard_corpus
from trainpipe.trainer.config import DataConfig, StoreConfig
corpus, tokenizer, store, settings = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
data = DataConfig(source=corpus, tokenizer=tokenizer, eot_token="<|endoftext|>", max_bytes=None, **settings)

@flow(name="shard-benchmark")
def measure():
    start = time.perf_counter()
    info = shard_corpus(data, StoreConfig(root=store))
    return {"wall_s": time.perf_counter() - start, "dataset_id": info.dataset_id,
            "tokenized_mb": info.work.tokenized_bytes / 2**20, "pieces": info.work.pieces,
            "tokens": info.manifest["splits"]["train"]["tokens"] + info.manifest["splits"]["val"]["tokens"]}

print(json.dumps(measure()))
"""


def make_corpus(folder: Path, size_mb: int) -> int:
    """Copies of the standard library's .py files under ``folder`` until ``size_mb``; bytes written."""
    from trainpipe.trainer.data.sources import list_source

    _, files = list_source("stdlib", None)
    written, copy = 0, 0
    while written < size_mb << 20:
        for f in files:
            text = f"# copy {copy} of {f.name}\n" + Path(f.path).read_text(encoding="utf-8", errors="replace")
            out = folder / f"copy{copy:03d}" / f.name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text, encoding="utf-8")
            written += len(text.encode())
            if written >= size_mb << 20:
                break
        copy += 1
    return written


def grow(folder: Path, share: float, seed: int = 0) -> int:
    """Add ``share`` of the corpus's file count as new files, each beside a random old one; bytes added."""
    rng = random.Random(seed)
    old = sorted(folder.rglob("*.py"))
    added = 0
    for i, base in enumerate(rng.sample(old, max(1, int(len(old) * share)))):
        new = base.with_name(f"{base.stem}_grown{i}.py")
        new.write_text(f"# grown {i}\n" + base.read_text(encoding="utf-8"), encoding="utf-8")
        added += new.stat().st_size
    return added


def train_tokenizer(corpus: Path, out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.rglob("*.py"))[:400]]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out))


def child(code: str, args: list[str], env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    fh = open(log, "ab")  # noqa: SIM115 - the server's log, open while it runs
    return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} did not start within {timeout:.0f} s")


def store_write_mbps(folder: Path, mb: int = 256) -> float:
    """The local disk's write bandwidth for shard-sized files, fsynced."""
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    for i in range(mb // 16):
        with open(folder / f"w{i}", "wb") as fh:
            for _ in range(16):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
    wall = time.perf_counter() - t0
    for i in range(mb // 16):
        (folder / f"w{i}").unlink()
    return mb / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=24, help="corpus size (MB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--piece-mb", type=float, default=2.0)
    ap.add_argument("--store-mbps", type=float, default=None, help="the store's write bandwidth (default: measured)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="shard-bench-") as tmp_name:
        tmp = Path(tmp_name)
        corpus = tmp / "corpus"
        nbytes = make_corpus(corpus, args.mb)
        mb = nbytes / 2**20
        tokenizer = tmp / "tokenizer.json"
        train_tokenizer(corpus, tokenizer, args.vocab)
        home = tmp / "prefect"
        home.mkdir()
        port, dask_port = free_port(), free_port()
        env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
               "TRAINPIPE_HOME": str(tmp / "trainpipe-home")}  # fmt: skip
        env.pop("TOKENIZERS_PARALLELISM", None)
        server = start([str(BIN / "prefect"), "server", "start", "--port", str(port)], tmp / "prefect.log", env)
        dask = [start([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(dask_port),
                       "--no-dashboard"], tmp / "dask.log", env)]  # fmt: skip
        dask += [start([str(BIN / "dask"), "worker", f"tcp://127.0.0.1:{dask_port}", "--nthreads", "1",
                        "--nworkers", "1", "--no-dashboard", "--local-directory", str(tmp)], tmp / "dask.log",
                       {**env, "TOKENIZERS_PARALLELISM": "false"}) for _ in range(2)]  # fmt: skip
        try:
            import urllib.request

            wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health").status == 200, "Prefect")
            from distributed import Client

            with Client(f"tcp://127.0.0.1:{dask_port}", timeout=60) as client:
                client.wait_for_workers(2, timeout=60)
            rows = run_rounds(args, tmp, corpus, tokenizer, env, dask_port)
        finally:
            for proc in (server, *dask):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        bandwidth = args.store_mbps or store_write_mbps(tmp)
        report(args, rows, mb, bandwidth)
        shutil.rmtree(tmp, ignore_errors=True)


def run_rounds(args, tmp: Path, corpus: Path, tokenizer: Path, env: dict, dask_port: int) -> dict[str, list[dict]]:
    one = {**env, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    base = {"piece_mb": args.piece_mb, "shard_tokens": 1 << 20}
    rows: dict[str, list[dict]] = {}
    child(LIBRARY, [str(corpus), str(tokenizer)], env)  # warms the page cache
    for r in range(args.rounds):
        order = [
            ("library, all cores", LIBRARY, None, env),
            ("library, one thread", LIBRARY, None, one),
            ("in-process", ENGINE, {**base, "workers": 1}, env),
            ("pool, 2 workers", ENGINE, {**base, "workers": 2}, env),
            ("dask, 2 workers", ENGINE, {**base, "engine": f"tcp://127.0.0.1:{dask_port}"}, env),
            ("one worker, one thread", ENGINE, {**base, "workers": 1}, one),
        ]
        random.Random(r).shuffle(order)  # interleaved: drift on a shared machine falls on every row alike
        for name, code, settings, run_env in order:
            store = tmp / f"store-{r}-{len(rows.get(name, []))}-{name.split(',')[0].replace(' ', '')}"
            argv = [str(corpus), str(tokenizer)] + ([] if settings is None else [str(store), json.dumps(settings)])
            rows.setdefault(name, []).append(child(code, argv, run_env))
            shutil.rmtree(store, ignore_errors=True)
        # A corpus grown by 1% of its files, against the full shard of the same store.
        grown_corpus = tmp / f"grown-{r}"
        shutil.copytree(corpus, grown_corpus)
        # A corpus grows long after its last shard: its files' stats have settled (sources.SETTLED_NS), so the find
        # pass knows the unchanged ones by their stat (source_hashes.py) and reads only the new ones.
        time.sleep(SETTLED_NS / 1e9)
        store = tmp / f"store-grown-{r}"
        auto = json.dumps(base)  # data.workers unset: one process per core and per 32 MB of text to tokenize
        full = child(ENGINE, [str(grown_corpus), str(tokenizer), str(store), auto], env)
        added = grow(grown_corpus, 0.01, seed=r)
        again = child(ENGINE, [str(grown_corpus), str(tokenizer), str(store), auto], env)
        rows.setdefault("grown: full", []).append(full)
        rows.setdefault("grown: +1% of files", []).append({**again, "added_mb": added / 2**20})
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(grown_corpus, ignore_errors=True)
    ids = {r["dataset_id"] for name, rs in rows.items() if not name.startswith(("library", "grown")) for r in rs}
    assert len(ids) == 1, f"the engines made different datasets: {ids}"
    return rows


def report(args, rows: dict[str, list[dict]], mb: float, bandwidth: float) -> None:
    wall = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in rows.items()}
    rate = {name: mb / w for name, w in wall.items()}
    base = rate["library, all cores"]
    print(f"shard throughput: {mb:.1f} MB of stdlib source, BPE vocab {args.vocab}, pieces of {args.piece_mb} MB, "
          f"{os.cpu_count()} CPUs, median of {args.rounds} interleaved rounds")  # fmt: skip
    print(f"{'':<26}{'wall s':>9}{'MB/s':>9}{'vs library (all cores)':>25}")
    for name in [n for n in wall if not n.startswith("grown")]:
        print(f"{name:<26}{wall[name]:>9.2f}{rate[name]:>9.2f}{rate[name] / base:>25.3f}")

    def paired(name: str, against: str) -> float:
        # Each round's ratio, then their median: a machine that drifts between rounds moves both sides of a pair.
        return statistics.median(b["wall_s"] / a["wall_s"] for a, b in zip(rows[name], rows[against], strict=True))

    scaling = paired("pool, 2 workers", "one worker, one thread")
    grown = 1 / paired("grown: +1% of files", "grown: full")
    added = statistics.median(r["added_mb"] for r in rows["grown: +1% of files"])
    tokenized = statistics.median(r["tokenized_mb"] for r in rows["grown: +1% of files"])
    lib = "library, all cores"
    print(f"engines vs library on all cores, median of each round's ratio (target >= 0.9): "
          f"in-process {paired('in-process', lib):.3f}, pool {paired('pool, 2 workers', lib):.3f}, "
          f"dask {paired('dask, 2 workers', lib):.3f}")  # fmt: skip
    print(f"2 workers vs 1 worker on one thread (target >= 1.7): {scaling:.2f}; the library's own all cores vs "
          f"one thread on this machine: {paired(lib, 'library, one thread'):.2f}")  # fmt: skip
    again, full = wall["grown: +1% of files"], wall["grown: full"]
    print(f"corpus grown by 1% of its files ({added:.2f} MB added, {tokenized:.2f} MB tokenized): "
          f"{again:.2f} s vs {full:.2f} s full = {grown:.3f} (target <= 0.05)")  # fmt: skip
    per_worker = rate["one worker, one thread"]
    tokens_per_byte = statistics.median(r["tokens"] for r in rows["in-process"]) / (mb * 2**20)
    out_per_byte = tokens_per_byte * 2  # uint16 tokens written per source byte
    print(f"projection for 100 GB (per-worker {per_worker:.2f} MB/s, store writes {bandwidth:.0f} MB/s, "
          f"{out_per_byte:.2f} bytes written per source byte):")  # fmt: skip
    for workers in (8, 64, 512):
        compute = 100 * 1024 / (per_worker * workers)
        store = 100 * 1024 * out_per_byte / bandwidth
        bound = "workers" if compute >= store else "store"
        print(f"  {workers:>4} workers: {max(compute, store) / 3600:6.2f} h ({bound}-bound: "
              f"tokenizing {compute / 3600:.2f} h, writing {store / 3600:.2f} h)")  # fmt: skip


if __name__ == "__main__":
    main()
