"""Training, loading and inspecting tokenizers."""

import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from ember.data import DataError, load_tokenizer, special_token_ids, train_tokenizer

WORDS = ("the quick brown fox jumps over lazy dog while parser returns value list of items "
         "function class module object string number file path encode decode naïve café").split()


def _documents(n: int = 300) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))).capitalize() + "."
            for _ in range(n)]


def test_wordpiece_has_bert_specials_and_normalises():
    tok = train_tokenizer("wordpiece", _documents(), vocab_size=200)
    assert 100 < tok.get_vocab_size() <= 200
    ids = special_token_ids(tok)
    assert {role: tok.id_to_token(i) for role, i in ids.items()} == {
        "sep": "[SEP]", "pad": "[PAD]", "mask": "[MASK]", "cls": "[CLS]", "unk": "[UNK]"}
    enc = tok.encode("The NAÏVE café", add_special_tokens=True)
    assert "[CLS]" not in enc.tokens and "[SEP]" not in enc.tokens  # packing adds separators
    assert tok.decode(enc.ids) == "the naive cafe"


def test_bpe_is_byte_level_and_lossless():
    tok = train_tokenizer("bpe", _documents(), vocab_size=400)
    assert tok.get_vocab_size() == 400
    ids = special_token_ids(tok)
    assert {role: tok.id_to_token(i) for role, i in ids.items()} == {
        "sep": "<|endoftext|>", "pad": "<|pad|>", "mask": "<|mask|>"}
    text = "Unseen ✓ 漢字 and\ttabs\n  spaces"
    enc = tok.encode(text, add_special_tokens=True)
    assert tok.decode(enc.ids) == text
    assert ids["sep"] not in enc.ids


def test_too_small_vocabulary_and_unknown_kind_are_refused():
    with pytest.raises(DataError, match="at least 256"):
        train_tokenizer("bpe", _documents(10), vocab_size=200)
    with pytest.raises(DataError, match="wordpiece, bpe"):
        train_tokenizer("sentencepiece", _documents(10), vocab_size=1000)


def test_load_tokenizer_round_trip_and_errors(tmp_path):
    tok = train_tokenizer("bpe", _documents(), vocab_size=300)
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert loaded.encode("quick brown fox").ids == tok.encode("quick brown fox").ids
    assert load_tokenizer(tmp_path).get_vocab_size() == 300  # a folder holding tokenizer.json
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")


def _wordlevel(tokens: list[str]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_user_tokenizers_special_roles():
    # GPT-2 style: one end-of-text token, no pad, no mask -> pad falls back to sep, mask None.
    assert special_token_ids(_wordlevel(["hello", "world", "<|endoftext|>"])) == {"sep": 2, "pad": 2, "mask": None}
    # RoBERTa style names.
    roberta = _wordlevel(["<s>", "<pad>", "</s>", "<unk>", "hi", "<mask>"])
    assert special_token_ids(roberta) == {"sep": 2, "pad": 1, "mask": 5, "cls": 0, "unk": 3}
    with pytest.raises(DataError, match="separator"):
        special_token_ids(_wordlevel(["<unk>", "hello", "world"]))


def test_training_progress_leaves_stdout_to_results(capfd):
    train_tokenizer("bpe", ["hello world, said the cat"] * 50, 300, show_progress=True)
    print("result")
    assert capfd.readouterr().out == "result\n"
