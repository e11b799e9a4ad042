"""The `ember data` verbs: corpus, prepare, stats."""

from __future__ import annotations

import os
from pathlib import Path

# prepare()'s settings a flag may give; None means "not given", so the TOML or the default applies.
_DEFAULTS = {"tokenizer": "bpe", "vocab_size": 8192, "seq_len": 128, "val_fraction": 0.01, "seed": 0,
             "shard_size": None, "workers": None, "doc_boundaries": False, "text_field": "text",
             "stopping": "first_exhausted", "curriculum": None, "tokenizer_documents": 0}


def default_workers() -> int:
    # One per core: the main process (reading, packing, writing) is light, about a
    # quarter of a worker's load with the cached BPE encoder.
    return max(1, min(os.cpu_count() or 1, 16))


def _cmd_corpus(args) -> int:
    from ember.data.corpus import write_stdlib_corpus

    stats = write_stdlib_corpus(Path(args.out))
    print(f"wrote {stats['documents']:,} documents ({stats['characters'] / 1e6:.1f} M characters) "
          f"from {stats['files']:,} standard-library files to {args.out}")
    return 0


def prepare_arguments(args) -> dict:
    """prepare() keyword arguments: flags over the --config TOML over the defaults."""
    from ember.data.clean import CleanConfig
    from ember.data.dedup import DedupConfig
    from ember.data.errors import DataError
    from ember.data.prep_config import load_prep_config

    kwargs = load_prep_config(Path(args.config)) if args.config else {}
    for key, default in _DEFAULTS.items():
        flag = getattr(args, key)
        if flag is not None and flag is not False:
            kwargs[key] = flag
        kwargs.setdefault(key, default)
    inputs = list(args.inputs or []) + list(args.source or [])
    if inputs:
        kwargs["inputs"] = inputs
    if "inputs" not in kwargs:
        raise DataError("no inputs given; name files or folders, use --source path:weight, "
                        "or [[source]] tables in --config.")
    clean = kwargs.get("clean") or CleanConfig()
    if args.normalize:
        clean.normalize = args.normalize
    clean.lowercase |= args.lowercase
    clean.strip_accents |= args.strip_accents
    clean.check()
    dedup = kwargs.get("dedup") or DedupConfig()
    if args.dedup in ("exact", "both"):
        dedup.exact = True
    if args.dedup in ("near", "both"):
        dedup = DedupConfig.from_dict({**dedup.to_dict(), "near": True})
    kwargs.update(clean=clean, dedup=dedup)
    from ember.data.tokenizer import KINDS

    given = [f"--{k.replace('_', '-')}" for k in ("vocab_size", "tokenizer_documents") if getattr(args, k)]
    # They size and sample a tokenizer to train, not a file's. A name that is neither (a misspelled
    # kind) is left to prepare's own refusal, which says so instead of blaming these flags.
    if kwargs["tokenizer"] not in KINDS and Path(kwargs["tokenizer"]).exists() and given:
        verb = "apply" if len(given) > 1 else "applies"
        raise DataError(f"{' and '.join(given)} only {verb} to a tokenizer ember trains; "
                        f"{kwargs['tokenizer']} brings its own vocabulary, so leave them out.")
    if kwargs["workers"] is None:
        kwargs["workers"] = default_workers()
    kwargs["progress"] = not args.quiet
    return kwargs


def _cmd_prepare(args) -> int:
    from ember.data.prepare import prepare
    from ember.process import sigterm_unwinds

    kwargs = prepare_arguments(args)
    # SIGTERM (kill, a scheduler) unwinds like Ctrl-C: the worker pool is shut down and the
    # last completed shard's state kept, instead of the workers outliving a killed parent.
    with sigterm_unwinds():
        manifest = prepare(kwargs.pop("inputs"), Path(args.out), **kwargs)
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    print(f"prepared {train['tokens']:,} train and {val['tokens']:,} held-out tokens "
          f"(vocabulary {manifest['vocab_size']:,}, sequences of {manifest['seq_len']}) in {args.out}")
    return 0


def _cmd_stats(args) -> int:
    from ember.data.stats import collect, plot_lengths, render

    from ember.data.errors import DataError

    if args.top < 0:
        raise DataError(f"--top must be 0 or more, not {args.top}.")
    stats = collect(Path(args.data_dir), top=args.top)
    png = plot_lengths(stats["histogram"], Path(args.png or Path(args.data_dir) / "document_lengths.png"))
    render(stats, png)
    return 0


def register_data(verbs) -> None:
    data = verbs.add_parser("data", help="prepare text into token shards").add_subparsers(dest="data_verb", required=True)
    corpus = data.add_parser("corpus", help="write the built-in corpus (Python standard-library docstrings)")
    corpus.add_argument("--out", required=True, help="JSON-lines file to write")
    corpus.set_defaults(func=_cmd_corpus)

    prep = data.add_parser("prepare", help="train or load a tokenizer, clean, tokenize, pack into shards")
    prep.add_argument("inputs", nargs="*", help=".txt/.jsonl/.parquet files (.gz/.zst too), folders, globs, hf:NAME")
    prep.add_argument("--source", action="append", metavar="PATH:WEIGHT",
                      help="a weighted source to mix (repeat it); weights are shares of the characters")
    prep.add_argument("--out", required=True, help="folder for shards, tokenizer.json and manifest.json")
    prep.add_argument("--config", help="preparation TOML: [prepare], [[source]], [clean], [dedup]")
    prep.add_argument("--tokenizer", help="wordpiece (masked LM), bpe (causal LM) or a tokenizer.json")
    prep.add_argument("--vocab-size", type=int)
    prep.add_argument("--tokenizer-documents", type=int, metavar="N",
                      help="train the tokenizer on the first N documents only (default: all)")
    prep.add_argument("--seq-len", type=int)
    prep.add_argument("--val-fraction", type=float)
    prep.add_argument("--seed", type=int)
    prep.add_argument("--text-field", help="the JSON field or parquet column holding the text (default text)")
    prep.add_argument("--shard-size", help="sequences per shard, or a size such as 64MB (default 65536 sequences)")
    prep.add_argument("--workers", type=int, help="tokenizing processes (default: one per core; 0: none)")
    prep.add_argument("--doc-boundaries", action="store_true",
                      help="save where documents start in each row (for data.document_mask)")
    prep.add_argument("--curriculum", choices=["sentence-length"],
                      help="record a per-row key (mean sentence length in tokens) for data.order = \"curriculum\"")
    prep.add_argument("--stopping", choices=["first_exhausted", "all_exhausted"], help="when a weighted mix ends")
    prep.add_argument("--normalize", choices=["NFC", "NFKC"], help="Unicode normalisation")
    prep.add_argument("--lowercase", action="store_true")
    prep.add_argument("--strip-accents", action="store_true")
    prep.add_argument("--dedup", choices=["exact", "near", "both"], help="drop duplicate documents")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(func=_cmd_prepare)

    stats = data.add_parser("stats", help="what a prepared folder holds and what preparing it dropped")
    stats.add_argument("data_dir")
    stats.add_argument("--png", help="where to write the document-length histogram "
                                     "(default DATA_DIR/document_lengths.png)")
    stats.add_argument("--top", type=int, default=20, help="how many frequent tokens to list")
    stats.set_defaults(func=_cmd_stats)
