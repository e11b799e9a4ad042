"""`ember data stats DATA_DIR`: what a prepared folder holds and what preparing it dropped.

Everything but the token frequencies comes from the manifest; the frequencies are
counted from the train shards one shard at a time (memory-mapped), so a large folder
costs time, not memory.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ember.atomic import write_atomic
from ember.data.manifest import load_manifest
from ember.data.tokenizer import load_tokenizer


def token_frequencies(data_dir: Path, manifest: dict) -> np.ndarray:
    counts = np.zeros(int(manifest["vocab_size"]), dtype=np.int64)
    for shard in manifest["splits"]["train"]["shards"]:
        rows = np.load(Path(data_dir) / shard["file"], mmap_mode="r")
        for start in range(0, len(rows), 65536):
            counts += np.bincount(np.asarray(rows[start:start + 65536]).ravel(), minlength=len(counts))[: len(counts)]
    return counts


def collect(data_dir: Path, top: int = 20) -> dict:
    """Every figure `ember data stats` shows, as plain data."""
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    tok = load_tokenizer(data_dir / manifest.get("tokenizer_file", "tokenizer.json"))
    freq = token_frequencies(data_dir, manifest)
    total = int(freq.sum())
    top_ids = [int(i) for i in np.argsort(-freq, kind="stable")[:top] if freq[i] > 0]
    dedup = manifest.get("dedup", {})
    duplicates = int(dedup.get("exact_duplicates", 0)) + int(dedup.get("near_duplicates", 0))
    kept = manifest.get("documents")
    tokens = manifest.get("document_tokens")
    return {
        "sources": manifest.get("source_stats") or [{"source": s} for s in manifest.get("sources", [])],
        "splits": {k: {"documents": v["documents"], "sequences": v["sequences"], "tokens": v["tokens"]}
                   for k, v in manifest["splits"].items()},
        "input_documents": manifest.get("input_documents"),
        "skipped": {**manifest.get("skipped", {}), **manifest.get("skipped_inputs", {})},
        "changed": manifest.get("cleaning", {}).get("changed", {}),
        "dropped": manifest.get("cleaning", {}).get("dropped", {}),
        "duplicates": {"exact": dedup.get("exact_duplicates", 0), "near": dedup.get("near_duplicates", 0),
                       "ratio": duplicates / (duplicates + kept) if kept else None},
        "characters_per_token": manifest["characters"] / tokens if tokens else None,
        "unigram_entropy": manifest.get("unigram_entropy"),
        "top_tokens": [{"id": i, "token": tok.id_to_token(i), "text": tok.decode([i], skip_special_tokens=False),
                        "share": float(freq[i]) / total} for i in top_ids],
        "histogram": manifest.get("document_length_histogram"),
    }


def plot_lengths(histogram: dict, out: Path) -> Path | None:
    """A bar chart of document lengths (tokens, log2 bins) as PNG; None without data."""
    if not histogram or not sum(histogram["documents"]):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = histogram["documents"]
    last = max(i for i, c in enumerate(counts) if c) + 1
    labels = [f"{s:,}" for s in histogram["bin_start_tokens"][:last]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(last), counts[:last], color="#3b6ea8")
    ax.set_xticks(range(last), labels, rotation=45, ha="right")
    ax.set_xlabel("document length in tokens (bin start, bins double)")
    ax.set_ylabel("documents")
    ax.set_title("Document lengths")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    write_atomic(Path(out), lambda handle: handle.write(buffer.getvalue()))
    return Path(out)


def render(stats: dict, png: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    sources = Table(title="Sources")
    for column in ("source", "weight", "read", "kept documents", "tokens", "characters"):
        sources.add_column(column, justify="left" if column == "source" else "right",
                           overflow="fold" if column == "source" else "ellipsis")
    for s in stats["sources"]:
        sources.add_row(str(s.get("source")), "" if s.get("weight") is None else f"{s['weight']:g}",
                        *(f"{s[k]:,}" if isinstance(s.get(k), int) else "?" for k in
                          ("documents_read", "documents", "tokens", "characters")))
    console.print(sources)
    steps = Table(title="Cleaning and skips (documents)")
    steps.add_column("step")
    steps.add_column("documents", justify="right")
    for group, label in (("skipped", "skipped"), ("changed", "changed by"), ("dropped", "dropped by")):
        for name, n in stats[group].items():
            steps.add_row(f"{label} {name}", f"{n:,}")
    d = stats["duplicates"]
    steps.add_row("exact duplicates", f"{d['exact']:,}")
    steps.add_row("near duplicates", f"{d['near']:,}")
    steps.add_row("duplicate ratio", "?" if d["ratio"] is None else f"{d['ratio']:.2%}")
    console.print(steps)
    splits = ", ".join(f"{k}: {v['documents']:,} documents, {v['tokens']:,} tokens" for k, v in stats["splits"].items())
    console.print(splits)
    cpt = stats["characters_per_token"]
    console.print(f"characters per token: {'?' if cpt is None else f'{cpt:.2f}'}   "
                  f"unigram entropy: {stats['unigram_entropy']:.3f} nats")
    tokens = Table(title="Most frequent train tokens")
    for column in ("id", "token", "decoded", "share"):
        tokens.add_column(column, justify="right" if column in ("id", "share") else "left")
    for t in stats["top_tokens"]:
        tokens.add_row(str(t["id"]), repr(t["token"]), repr(t["text"]), f"{t['share']:.2%}")
    console.print(tokens)
    console.print(f"document-length histogram: {png}" if png else "document-length histogram: no data")
