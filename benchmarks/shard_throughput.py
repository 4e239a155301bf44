"""Shard-stage throughput and memory, against reading the same files raw, in one run.

A corpus of the standard library's source is copied to a temporary folder at two sizes (each copy of a
file gets its own first line, so no two documents are equal). Every measurement runs in a fresh process,
so its peak RSS is its own:

- raw: read every file through fsspec in 1 MiB blocks and do nothing with the bytes (the baseline);
- byte / bpe: ``shard_dataset`` into an empty store (bpe includes training the tokenizer on the corpus).

Figures: MB/s of source text for each, as a ratio to raw; peak RSS at each size, and the ratio of the
large corpus's peak to the small one's (bounded memory: about 1.0, not the size ratio).

    .venv/bin/python benchmarks/shard_throughput.py [--small-mb 16] [--large-mb 64] [--buffer-mb 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
mode, corpus, store, buffer_mb = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
from trainpipe.trainer.config import DataConfig, StoreConfig
from trainpipe.trainer.data.shard import shard_dataset
from trainpipe.trainer.data.sources import list_source
import fsspec
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if mode == "raw":
    fs, files = list_source(corpus + "/**/*.py", None)
    for f in files:
        with fs.open(f.path, "rb") as fh:
            while fh.read(1 << 20):
                pass
else:
    data = DataConfig(source=corpus + "/**/*.py", tokenizer=mode, vocab_size=4096, buffer_mb=buffer_mb)
    shard_dataset(data, StoreConfig(root=store))
wall = time.perf_counter() - start
print(json.dumps({"wall_s": wall, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "imports_mb": base / 1024}))
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


def measure(mode: str, corpus: Path, store: Path, buffer_mb: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), mode, str(corpus), str(store), str(buffer_mb)],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "true"},
    )
    if proc.returncode:
        raise SystemExit(f"{mode} on {corpus} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small-mb", type=int, default=16)
    ap.add_argument("--large-mb", type=int, default=64)
    ap.add_argument("--buffer-mb", type=int, default=1)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="shard-bench-") as tmp:
        rows = {}
        for size in (args.small_mb, args.large_mb):
            corpus = Path(tmp, f"corpus-{size}")
            nbytes = make_corpus(corpus, size)
            for mode in ("raw", "raw", "byte", "bpe"):  # the first raw read warms the page cache
                store = Path(tmp, f"store-{size}-{mode}")
                rows[size, mode] = measure(mode, corpus, store, args.buffer_mb) | {"mb": nbytes / 1e6}
        print(f"shard throughput ({os.cpu_count()} CPUs, data.buffer_mb={args.buffer_mb}, bpe vocab 4096)")
        print(f"{'corpus':>8} {'mode':>5} {'wall s':>8} {'MB/s':>8} {'vs raw':>8} {'peak RSS MB':>12}")
        for (size, mode), r in rows.items():
            mbps = r["mb"] / r["wall_s"]
            raw = rows[size, "raw"]
            ratio = mbps / (raw["mb"] / raw["wall_s"])
            print(f"{r['mb']:>6.1f}MB {mode:>5} {r['wall_s']:>8.2f} {mbps:>8.1f} {ratio:>8.3f} {r['peak_mb']:>12.0f}")
        for mode in ("raw", "byte", "bpe"):
            small, large = rows[args.small_mb, mode], rows[args.large_mb, mode]
            print(
                f"peak RSS {mode:>4}: {small['peak_mb']:.0f} MB at {small['mb']:.0f} MB, {large['peak_mb']:.0f} MB at "
                f"{large['mb']:.0f} MB: ratio {large['peak_mb'] / small['peak_mb']:.2f} for "
                f"{large['mb'] / small['mb']:.1f}x the corpus"
            )


if __name__ == "__main__":
    main()
