"""The cached byte-level BPE encoder gives exactly the tokenizer's ids, or is not used."""

import json

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from ember.data import train_tokenizer
from ember.data.fastbpe import CachedBPE, applies

TRICKY = [
    "plain words, punctuation; and numbers 12345 67.8",
    "contractions: don't it's we're they've I'm you'll he'd 'S 'T",
    "whitespace  runs\t\ttabs\n\n\nnewlines   \r\n trailing   ",
    "   leading spaces and a final space ",
    "unicode: café naïve Ωmega 日本語 한국어 emoji 🙂👍🏽 math ∑∫ ﬁ",
    "code: def f(x):\n    return x**2  # comment\n\tif a_b == c-d: pass",
    "special token inside <|endoftext|> the text and <|mask|> too",
    "mixed123abc 4th 1st_place __init__ x--y ...!!! ¿qué?",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "",
]


def test_same_ids_as_the_tokenizer_on_real_and_tricky_text(corpus):
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()][:600] + TRICKY
    tok = train_tokenizer("bpe", docs, 600)
    assert applies(tok)
    fast = CachedBPE(tok)
    reference = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    assert fast.encode_batch(docs) == reference
    assert fast.encode_batch(docs) == reference  # again, now from the cache
    assert fast.verify(TRICKY) and len(fast.cache) > 1000


def test_other_tokenizers_are_left_to_encode_batch():
    assert not applies(train_tokenizer("wordpiece", ["some text here"], 120))
    tok = train_tokenizer("bpe", ["some text here"], 260)
    tok.normalizer = normalizers.Lowercase()
    assert not applies(tok)
    tok = Tokenizer(models.BPE(dropout=0.1))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert not applies(tok)
    tok = train_tokenizer("bpe", ["some text here"], 260)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not applies(tok)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.enable_truncation(8)
    assert not applies(tok)
