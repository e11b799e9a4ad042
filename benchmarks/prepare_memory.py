"""Bounded memory of `ember data prepare`: peak RSS on a corpus and on one 4x its size.

    PYTHONPATH=src python benchmarks/prepare_memory.py --mb 40 \
        --out benchmarks/results/DATE-prepare-memory-cpu.txt

The corpora are the built-in one (`ember data corpus`) repeated until about `--mb`
megabytes and `--factor` times that, as JSON lines, every copy after the first made
distinct by a prefix (dedup is off anyway). A byte-level BPE (8,192 tokens) is trained once on
the built-in corpus and passed as a file, so both runs do the same work per byte. Each
preparation uses the command's defaults (one worker per core, shards of 65,536 rows,
which is smaller than either corpus's output) and runs in its own subprocess, and reports:

- peak tree RSS: the largest sum of the resident set sizes of the process and its worker
  processes, sampled every 20 ms from /proc;
- getrusage: the main process's own maxrss (RUSAGE_SELF) and the largest worker's
  (RUSAGE_CHILDREN, after the workers are joined), and main + workers x largest worker,
  an upper bound of the tree's peak that needs no sampling;
- MB/s: input megabytes over the preparation's wall time (imports excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare_vs_datasets import make_corpus, run_side  # noqa: E402  (a sibling script, not a package)

SRC = Path(__file__).resolve().parents[1] / "src"


def side(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    """One preparation, in this (sub)process."""
    from ember.data import prepare

    start = time.perf_counter()
    m = prepare([corpus], out, tokenizer=str(tokenizer), workers=workers, progress=False)
    seconds = time.perf_counter() - start
    kib = 1024  # Linux reports ru_maxrss in KiB
    return {"seconds": seconds, "shards": len(m["splits"]["train"]["shards"]),
            "train_tokens": m["splits"]["train"]["tokens"],
            "self_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib / 1e6,
            "children_maxrss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib / 1e6}


def measure(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    """`side` in a subprocess, its tree RSS sampled from here."""
    result = run_side(["--side", str(corpus), "--tokenizer", str(tokenizer), "--data", str(out),
                       "--workers", str(workers)], script=__file__)
    result.update(tree_peak_mb=result.pop("peak_rss_mb"), input_mb=corpus.stat().st_size / 1e6)
    result["mb_per_s"] = result["input_mb"] / result["seconds"]
    result["bound_mb"] = result["self_maxrss_mb"] + workers * result["children_maxrss_mb"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=float, default=40.0, help="size of the smaller corpus in MB")
    parser.add_argument("--factor", type=int, default=4, help="the larger corpus is this many times the smaller")
    parser.add_argument("--workers", type=int, default=max(1, min(os.cpu_count() or 1, 16)))
    parser.add_argument("--work", help="folder for corpora and outputs (default: a temporary one)")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(side(Path(args.side), Path(args.tokenizer), Path(args.data), args.workers)))
        return

    from ember.data import train_tokenizer
    from ember.data.corpus import write_stdlib_corpus

    work = Path(args.work or tempfile.mkdtemp(prefix="ember-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    started, load_start = datetime.now(timezone.utc), os.getloadavg()
    base = work / "stdlib.jsonl"
    if not base.exists():
        write_stdlib_corpus(base)
    tokenizer = work / "tokenizer.json"
    if not tokenizer.exists():
        texts = (json.loads(line)["text"] for line in base.read_text(encoding="utf-8").splitlines())
        train_tokenizer("bpe", texts, 8192).save(str(tokenizer))
    copies = max(1, round(args.mb * 1e6 / base.stat().st_size))
    rows = []
    for n in (copies, copies * args.factor):
        corpus = make_corpus(work, n)
        out = work / f"prepared_x{n}_{time.time_ns()}"
        rows.append((n, measure(corpus, tokenizer, out, args.workers)))
        print(f"x{n}: {rows[-1][1]['tree_peak_mb']:.0f} MB peak", file=sys.stderr)

    lines = [
        f"# ember data prepare: peak memory at two corpus sizes ({started:%Y-%m-%d %H:%M} UTC)",
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
        f"{platform.platform()}",
        "command: PYTHONPATH=src python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:]),
        f"load average (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in load_start)}, "
        f"at end {os.getloadavg()[0]:.1f} (a shared machine: MB/s vary with other users' load)",
        f"corpus: built-in corpus ({base.stat().st_size / 1e6:.1f} MB) repeated, every copy after the first prefixed; "
        f"BPE 8192 tokenizer file, seq_len 128, shards of 65,536 rows (16.8 MB), {args.workers} workers, no dedup",
        "tree peak = max over 20 ms samples of the summed RSS of main + workers; "
        "bound = main maxrss + workers x largest worker maxrss (getrusage)",
        "",
        f"{'corpus':<16}{'input MB':>9}{'seconds':>9}{'MB/s':>7}{'cpu s':>8}{'shards':>8}"
        f"{'tree peak MB':>13}{'main MB':>9}{'worker MB':>10}{'bound MB':>9}",
    ]
    for n, r in rows:
        lines.append(f"{'x' + str(n):<16}{r['input_mb']:>9.1f}{r['seconds']:>9.1f}{r['mb_per_s']:>7.2f}"
                     f"{r['cpu_s']:>8.1f}{r['shards']:>8}{r['tree_peak_mb']:>13.0f}{r['self_maxrss_mb']:>9.0f}"
                     f"{r['children_maxrss_mb']:>10.0f}{r['bound_mb']:>9.0f}")
    (a_n, a), (b_n, b) = rows
    lines.append(f"x{b_n // a_n} the input -> {b['tree_peak_mb'] / a['tree_peak_mb']:.2f}x the tree peak, "
                 f"{b['bound_mb'] / a['bound_mb']:.2f}x the getrusage bound")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
