"""Preparing a corpus: ember vs the plain `datasets` approach; peak memory; loader speed.

    PYTHONPATH=src python benchmarks/prepare_vs_datasets.py --copies 4 --out results.txt

The corpus is the built-in one (`ember data corpus`), repeated `--copies` times with
each copy's documents made distinct (a copy tag per document), as JSON lines. Both
sides tokenize with the same tokenizer.json (a byte-level BPE trained once on the
corpus) into rows of `--seq-len` tokens:

- ember: `prepare(..., tokenizer=<file>, workers=N)` (no held-out split, like the plain side)
- plain: what a user would otherwise write, following transformers' run_clm.py:
  `load_dataset("json")`, `Dataset.map` with a `PreTrainedTokenizerFast` over the same
  file (batched), a second `map` that concatenates and chunks into rows (group_texts),
  and `np.save` of the rows.

Each side runs in its own subprocess; its peak memory is the peak of the summed RSS of
the process and its children (sampled every 20 ms from /proc), so ember's worker
processes are counted. Throughput is input JSONL megabytes per second of the work
(imports excluded). `--rss` adds ember's peak memory on the corpus and on one
`--rss-factor` times its size; `--loader` measures `Batches.next` + `make_targets`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path


def _tree_rss(pid: int) -> int:
    """Summed RSS (bytes) of `pid` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
        stack += children.get(p, [])
    return total


def run_side(argv: list[str], script: str = __file__) -> dict:
    """Run `script` (this one by default) as a subprocess with `argv`: its JSON result, the
    peak tree RSS and the CPU seconds of the process and its (reaped) worker processes."""
    proc = subprocess.Popen([sys.executable, script, *argv], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")})
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # rusage of the child and its reaped children
    done.set()
    thread.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"side {argv[:2]} failed with status {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_mb"] = peak[0] / 1e6
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    return result


def side_ember(corpus: Path, tokenizer: Path, out: Path, seq_len: int, workers: int, dedup: bool) -> dict:
    from ember.data.prepare import prepare

    start = time.perf_counter()
    m = prepare([corpus], out, tokenizer=str(tokenizer), seq_len=seq_len, val_fraction=0.0,
                workers=workers, progress=False, dedup={"exact": dedup, "near": dedup})
    return {"seconds": time.perf_counter() - start, "rows": m["splits"]["train"]["sequences"]}


def side_plain(corpus: Path, tokenizer: Path, out: Path, seq_len: int) -> dict:
    import numpy as np
    from datasets import disable_progress_bars, load_dataset
    from transformers import PreTrainedTokenizerFast

    disable_progress_bars()
    start = time.perf_counter()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer), eos_token="<|endoftext|>")
    ds = load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(out / "cache"))

    def tokenize(batch):
        return {"input_ids": [ids + [tok.eos_token_id] for ids in tok(batch["text"])["input_ids"]]}

    ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names)

    def group_texts(batch):  # transformers' run_clm.py
        concatenated = [t for ids in batch["input_ids"] for t in ids]
        total = (len(concatenated) // seq_len) * seq_len
        return {"input_ids": [concatenated[i:i + seq_len] for i in range(0, total, seq_len)]}

    ds = ds.map(group_texts, batched=True)
    rows = np.array(ds["input_ids"], dtype=np.uint16)
    np.save(out / "rows.npy", rows)
    return {"seconds": time.perf_counter() - start, "rows": int(len(rows))}


def side_loader(data_dir: Path, batch: int, steps: int) -> dict:
    from ember.config import DataConfig
    from ember.data import Batches, load_manifest, make_targets

    m = load_manifest(data_dir)
    out = {}
    for objective in ("causal", "mlm"):
        data = Batches(data_dir, m, "train", seed=0)
        data.next(batch)  # warm the page cache
        start = time.perf_counter()
        for step in range(steps):
            ids = data.next(batch).ids
            make_targets(ids, objective, DataConfig(), m["special_tokens"], m["vocab_size"], 0, step * batch)
        out[f"{objective}_tokens_per_s"] = steps * batch * int(m["seq_len"]) / (time.perf_counter() - start)
    return out


def make_corpus(folder: Path, copies: int) -> Path:
    from ember.data.corpus import write_stdlib_corpus

    base = folder / "stdlib.jsonl"
    if not base.exists():
        write_stdlib_corpus(base)
    path = folder / f"corpus_x{copies}.jsonl"
    if not path.exists():
        rows = [json.loads(line)["text"] for line in base.read_text(encoding="utf-8").splitlines()]
        with open(path, "w", encoding="utf-8") as handle:
            for copy in range(copies):
                for text in rows:
                    handle.write(json.dumps({"text": f"[copy {copy}] {text}" if copy else text}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["ember", "plain", "loader"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--dedup", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help="folder for corpora and outputs (default: a temporary one)")
    parser.add_argument("--copies", type=int, default=4, help="copies of the built-in corpus to prepare")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=max(1, min(os.cpu_count() or 1, 16)),
                        help="ember's workers (default: the command's, one per core)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per side; the median is reported")
    parser.add_argument("--rss", action="store_true", help="also ember's peak memory at 1x and --rss-factor x")
    parser.add_argument("--rss-factor", type=int, default=4)
    parser.add_argument("--loader", action="store_true", help="also the loader's tokens/s")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()

    if args.side == "ember":
        print(json.dumps(side_ember(Path(args.corpus), Path(args.tokenizer), Path(args.data), args.seq_len, args.workers,
                                    args.dedup)))
        return
    if args.side == "plain":
        print(json.dumps(side_plain(Path(args.corpus), Path(args.tokenizer), Path(args.data), args.seq_len)))
        return
    if args.side == "loader":
        print(json.dumps(side_loader(Path(args.data), 64, 200)))
        return

    load_at_start = os.getloadavg()
    work = Path(args.work or tempfile.mkdtemp(prefix="ember-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(work, args.copies)
    tokenizer = work / "tokenizer.json"
    if not tokenizer.exists():
        from ember.data import iter_documents, train_tokenizer

        train_tokenizer("bpe", iter_documents([make_corpus(work, 1)]), args.vocab_size).save(str(tokenizer))
    mb = corpus.stat().st_size / 1e6

    def prepare_side(side: str, path: Path, tag: str, workers: int = args.workers, dedup: bool = False) -> dict:
        out = work / f"out-{tag}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        out.mkdir(parents=True) if side == "plain" else None
        argv = ["--side", side, "--corpus", str(path), "--tokenizer", str(tokenizer), "--data", str(out),
                "--seq-len", str(args.seq_len), "--workers", str(workers)] + (["--dedup"] if dedup else [])
        result = run_side(argv)
        result["mb_per_s"] = path.stat().st_size / 1e6 / result["seconds"]
        return result

    runs: dict[str, list[dict]] = {"ember": [], "plain": []}
    for _ in range(args.repeat):  # interleaved, so a change in the machine's load hits both sides
        runs["ember"].append(prepare_side("ember", corpus, "ember"))
        runs["plain"].append(prepare_side("plain", corpus, "plain"))
    ember, plain = (sorted(runs[k], key=lambda r: r["seconds"])[len(runs[k]) // 2] for k in ("ember", "plain"))

    walls = {k: ", ".join(f"{r['seconds']:.1f}" for r in v) for k, v in runs.items()}

    def row(name: str, r: dict) -> str:
        return (f"{name:<30}{r['seconds']:>9.2f}{r['mb_per_s']:>8.2f}{r['cpu_s']:>9.1f}"
                f"{r['peak_rss_mb']:>13.0f}{r['rows']:>10,}")

    lines = [
        f"# ember data prepare vs the plain datasets approach ({datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC})",
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}, {platform.platform()}",
        f"command: PYTHONPATH=src python benchmarks/prepare_vs_datasets.py {' '.join(sys.argv[1:])}",
        f"load average (1/5/15 min) at start {load_at_start[0]:.1f}/{load_at_start[1]:.1f}/{load_at_start[2]:.1f}, "
        f"at end of the comparison {os.getloadavg()[0]:.1f} (a shared machine: wall times vary between runs)",
        f"corpus: built-in corpus x{args.copies} = {mb:.1f} MB of JSON lines; BPE vocabulary {args.vocab_size}, "
        f"seq_len {args.seq_len}",
        f"median of {args.repeat} interleaved runs per side (wall seconds: "
        f"ember {walls['ember']}; plain {walls['plain']}); "
        "cpu s = user + system time of the process and its workers",
        "",
        f"{'side':<30}{'seconds':>9}{'MB/s':>8}{'cpu s':>9}{'peak RSS MB':>13}{'rows':>10}",
        row(f"ember ({args.workers} workers)", ember),
        row("plain datasets map", plain),
        f"throughput ratio ember / plain: {ember['mb_per_s'] / plain['mb_per_s']:.2f}x (wall), "
        f"{plain['cpu_s'] / ember['cpu_s']:.2f}x (CPU time); peak memory ratio: "
        f"{ember['peak_rss_mb'] / plain['peak_rss_mb']:.2f}x",
    ]
    for workers in sorted({0, 1, 2, args.workers} - {args.workers}):
        lines.append(row(f"ember ({workers} workers)", prepare_side("ember", corpus, f"ember-w{workers}", workers)))
    lines.append(row(f"ember ({args.workers} w, exact+near dedup)",
                     prepare_side("ember", corpus, "ember-dedup", dedup=True)))
    if args.rss:
        small = make_corpus(work, 1)
        big = make_corpus(work, args.rss_factor)
        a = prepare_side("ember", small, "rss-1")
        b = prepare_side("ember", big, f"rss-{args.rss_factor}")
        lines += ["", f"ember peak memory (process + workers): x1 corpus ({small.stat().st_size / 1e6:.1f} MB) "
                      f"{a['peak_rss_mb']:.0f} MB; x{args.rss_factor} corpus ({big.stat().st_size / 1e6:.1f} MB) "
                      f"{b['peak_rss_mb']:.0f} MB"]
    if args.loader:
        loader = run_side(["--side", "loader", "--data", str(work / "out-ember")])
        lines += ["", f"loader (Batches.next + make_targets, batch 64 x {args.seq_len}, one process): "
                      f"causal {loader['causal_tokens_per_s']:,.0f} tokens/s, mlm {loader['mlm_tokens_per_s']:,.0f} tokens/s"]
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
