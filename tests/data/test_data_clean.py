"""Cleaning: transforms, filters, dedup, the prep TOML, each counted in the manifest."""

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from ember.data import DataError, load_manifest, load_tokenizer, prepare
from ember.data.clean import CleanConfig, duplicate_line_fraction, text_filter, top_ngram_fraction, transform
from ember.data.dedup import DedupConfig, Deduplicator, Signer, exact_key
from ember.data.prep_config import load_prep_config, shard_sequences_for
from ember.data.tokenizer import with_cleaning

WORDS = ("model data token layer value return the a of to in is for with that by this list string "
         "number file object function class module parser error result index").split()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


def _decoded_documents(out: Path) -> list[str]:
    m = load_manifest(out)
    tok = load_tokenizer(out / "tokenizer.json")
    stream = [t for split in ("train", "val") for s in m["splits"][split]["shards"]
              for t in np.load(out / s["file"]).ravel().tolist()]
    return tok.decode(stream, skip_special_tokens=False).split("<|endoftext|>")


def test_transforms_and_their_counts():
    config = CleanConfig(normalize="NFKC", strip_accents=True, lowercase=True, ascii_only=True)
    changed = Counter()
    assert transform("Ｆｕｌｌ ﬁle Café Ünïcode ✓ ok", config, changed) == "full file cafe unicode  ok"
    assert transform("plain", config, changed) == "plain"
    assert changed == {"normalize": 1, "strip_accents": 1, "lowercase": 1, "ascii_only": 1}
    assert transform("Ｆｕｌｌ Café", CleanConfig(normalize="NFC")) == "Ｆｕｌｌ Café"


def test_filters_decide_on_the_text():
    assert duplicate_line_fraction("a\nb\na\na") == 0.5
    assert top_ngram_fraction("x y x y x y".split(), 2) == 1.0
    assert top_ngram_fraction("a b c d e f".split(), 2) == 0.0
    config = CleanConfig(min_chars=10, max_chars=200, min_words=3, max_duplicate_line_fraction=0.3,
                         max_top_ngram_fraction={2: 0.2})
    assert text_filter("short", config) == "min_chars"
    assert text_filter("x" * 201, config) == "max_chars"
    assert text_filter("twowords only", config) == "min_words"
    assert text_filter("same line here\nsame line here\nother line there", config) == "duplicate_lines"
    assert text_filter("buy now buy now buy now buy now", config) == "top_ngram"
    assert text_filter("A normal sentence with several different words in it.", config) is None
    with pytest.raises(DataError, match="normalize 'NFD' is unknown"):
        CleanConfig.from_dict({"normalize": "NFD"})
    with pytest.raises(DataError, match="no setting lowercased"):
        CleanConfig.from_dict({"lowercased": True})


def test_dedup_keys_and_signatures():
    assert exact_key("Hello   World\n") == exact_key("hello world") != exact_key("hello world!")
    config = DedupConfig(exact=True, near=True, threshold=0.7)
    rng = random.Random(0)
    base = _text(rng, 120)
    near = base.replace(base.split()[5], "zebra", 1)
    other = _text(rng, 120)
    signer, dedup = Signer(config), Deduplicator(config)
    assert dedup.duplicate(exact_key(base), signer.sign(base)) is None
    assert dedup.duplicate(exact_key(base.upper()), signer.sign(base.upper())) == "exact_duplicates"
    assert dedup.duplicate(exact_key(near), signer.sign(near)) == "near_duplicates"
    assert dedup.duplicate(exact_key(other), signer.sign(other)) is None


def test_cleaning_and_dedup_in_prepare(tmp_path):
    rng = random.Random(5)
    unique = [f"Doc {i}: " + _text(rng, rng.randint(30, 80)) for i in range(300)]
    docs = list(unique)
    docs.insert(10, unique[3].upper())  # exact duplicate after normalising case
    docs.insert(20, unique[4].replace(unique[4].split()[6], "zebra", 1))  # near duplicate
    docs.insert(30, "tiny")  # below min_chars
    docs.insert(40, "spam spam spam " * 30)  # top n-gram
    junk = "".join(rng.choice("QXZJKVWqxzjkvw0123456789+/=") for _ in range(200))
    docs.insert(50, junk)  # base64-like noise: compresses badly
    docs.insert(60, "Ｃａｆé ﬁle déjà vu, " + _text(rng, 40))  # transformed, kept
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    toml = tmp_path / "prep.toml"
    toml.write_text(
        '[prepare]\nseq_len = 16\nvocab_size = 512\nworkers = 0\nshard_size = "4KB"\n'
        '[clean]\nnormalize = "NFKC"\nstrip_accents = true\nlowercase = true\nmin_chars = 20\n'
        'max_top_ngram_fraction = {2 = 0.3}\nmax_tokens_per_char = 0.5\n'
        '[dedup]\nexact = true\nnear = true\nthreshold = 0.7\n')
    config = load_prep_config(toml)
    shard_size = config.pop("shard_size")
    assert config["vocab_size"] == 512 and config["workers"] == 0 and shard_size == "4KB"
    m = prepare([path], tmp_path / "out", progress=False, shard_size=shard_size, **config)
    assert m["cleaning"]["dropped"] == {"min_chars": 1, "top_ngram": 1, "compression": 1}
    assert m["dedup"]["exact_duplicates"] == 1 and m["dedup"]["near_duplicates"] == 1
    assert m["cleaning"]["changed"]["lowercase"] >= 300 and m["cleaning"]["changed"]["normalize"] == 1
    assert m["documents"] == 301 and m["input_documents"] == len(docs)
    assert all(s["sequences"] <= 4000 // (16 * 2) for s in m["splits"]["train"]["shards"])
    kept = _decoded_documents(tmp_path / "out")
    assert "cafe file deja vu, " in "".join(kept)
    assert unique[3].lower() in kept[:12]  # the first copy is the one kept
    assert not any("zebra" in d or "spam" in d for d in kept)
    assert sum(m["document_length_histogram"]["documents"]) == 301
    # The tokenizer carries the transforms, so text it meets later is read as its training text was.
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert tok.normalizer.normalize_str("Ｃａｆé ﬁle DÉJÀ") == "cafe file deja"
    ascii_only = with_cleaning(Tokenizer(models.BPE()), CleanConfig(ascii_only=True))
    assert ascii_only.normalizer.normalize_str("naïve → café") == "nave  caf"


def test_prep_config_errors(tmp_path):
    example = load_prep_config(Path(__file__).resolve().parents[2] / "configs/data/cram-clean.toml")
    assert example["clean"].max_tokens_per_char == 0.3 and example["dedup"].near
    bad = tmp_path / "bad.toml"
    for text, words in [("[prepare]\nseqlen = 3\n", "no setting seqlen"), ("[cleaning]\n", "unknown section cleaning"),
                        ("[prepare]\nseq_len = '8'\n", "wrong type"), ("[dedup]\nthreshold = 2.0\n", "threshold"),
                        ("[[source]]\nweight = 1\n", "needs path"), ("[prepare\n", "not valid TOML")]:
        bad.write_text(text)
        with pytest.raises(DataError, match=words):
            load_prep_config(bad)
    assert shard_sequences_for("64MB", 128, 2) == 250_000 and shard_sequences_for("1000", 128, 4) == 1000
    with pytest.raises(DataError, match="size like 64MB"):
        shard_sequences_for("lots", 128, 2)
    with pytest.raises(DataError, match="no whole sequence"):
        shard_sequences_for("1KB", 1024, 2)
