"""Train or load a Hugging Face `tokenizers` tokenizer and find its special tokens.

No post-processor adds [CLS]/[SEP] on encode: packing inserts one separator after every
document itself, so the shards hold exactly the tokens the model sees.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ember.data.errors import DataError

WORDPIECE_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BPE_SPECIALS = ["<|endoftext|>", "<|pad|>", "<|mask|>"]
KINDS = ("wordpiece", "bpe")

# Names each role goes by in common tokenizers, most specific first.
ROLE_NAMES = {
    "sep": ["[SEP]", "</s>", "<|endoftext|>", "<eos>"],
    "pad": ["[PAD]", "<pad>", "<|pad|>"],
    "mask": ["[MASK]", "<mask>", "<|mask|>"],
    "cls": ["[CLS]", "<s>", "<cls>"],
    "unk": ["[UNK]", "<unk>", "<|unk|>"],
}


def min_vocab_size(kind: str) -> int:
    # Byte-level BPE starts from 256 byte symbols; WordPiece needs room for characters.
    return 256 if kind == "bpe" else 100


def _wordpiece(vocab_size: int, show_progress: bool) -> tuple[Tokenizer, trainers.Trainer]:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    # BertNormalizer: clean control characters, NFD + strip accents, lowercase.
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=True, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=WORDPIECE_SPECIALS,
                                        continuing_subword_prefix="##", show_progress=show_progress)
    return tok, trainer


def _bpe(vocab_size: int, show_progress: bool) -> tuple[Tokenizer, trainers.Trainer]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=BPE_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=show_progress)
    return tok, trainer


def train_tokenizer(kind: str, documents: Iterable[str], vocab_size: int,
                    show_progress: bool = False) -> Tokenizer:
    """A WordPiece (masked LM) or byte-level BPE (causal LM) tokenizer trained on `documents`."""
    if kind not in KINDS:
        raise DataError(f"tokenizer kind {kind!r} is unknown; use wordpiece, bpe or a path to a tokenizer.json.")
    if vocab_size < min_vocab_size(kind):
        raise DataError(f"vocab_size {vocab_size} is too small for {kind}; use at least {min_vocab_size(kind)}.")
    tok, trainer = (_wordpiece if kind == "wordpiece" else _bpe)(vocab_size, show_progress)
    with _stdout_to_stderr() if show_progress else contextlib.nullcontext():
        tok.train_from_iterator(documents, trainer=trainer)
    return _fixed_ids(tok) if kind == "wordpiece" else tok


def with_cleaning(tok: Tokenizer, clean) -> Tokenizer:
    """A copy of `tok` with the cleaning's text transforms (data/clean.py: `normalize`, `strip_accents`,
    `lowercase`, `ascii_only`, in that order) ahead of its own normaliser. Its training
    text went through them; text it meets later (GLUE, the users of an exported model)
    does not, and without them "ＡＢＣ" would be [UNK] where the training text had "ABC".
    Each is idempotent, so the prepared shards do not change."""
    from tokenizers import Regex

    steps = []
    if clean.normalize:
        steps.append(getattr(normalizers, clean.normalize)())
    if clean.strip_accents:
        steps += [normalizers.NFD(), normalizers.StripAccents()]
    if clean.lowercase:
        steps.append(normalizers.Lowercase())
    if clean.ascii_only:
        steps.append(normalizers.Replace(Regex("[^\\x00-\\x7f]"), ""))
    tok = Tokenizer.from_str(tok.to_str())
    if steps:
        tok.normalizer = normalizers.Sequence(steps + ([tok.normalizer] if tok.normalizer is not None else []))
    return tok


def _fixed_ids(tok: Tokenizer) -> Tokenizer:
    """WordPiece numbered in a fixed order: its trainer numbers the characters it starts
    from in hash-map order, which changes from process to process, and with them every
    shard. A WordPiece model looks tokens up by their text, so ids in any order tokenize
    alike: the specials keep theirs and the rest follow sorted."""
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    specials = [t for t in WORDPIECE_SPECIALS if t in vocab]
    order = specials + sorted(set(vocab) - set(specials))
    data["model"]["vocab"] = {token: i for i, token in enumerate(order)}
    for added in data.get("added_tokens", []):
        added["id"] = data["model"]["vocab"][added["content"]]
    return Tokenizer.from_str(json.dumps(data))


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """The trainer's progress bars end each stage with a newline on file descriptor 1, even
    when they draw nothing; stdout is for results, so it writes to stderr meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def load_tokenizer(path: Path) -> Tokenizer:
    """An existing tokenizer.json (or a folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist; pass an existing tokenizer.json.")
    open(path, "rb").close()  # unreadable: an OSError naming the file, not a malformed tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{path} is not a valid tokenizer.json ({first}); "
                        "pass a file saved by Hugging Face tokenizers.") from None


def special_token_ids(tok: Tokenizer) -> dict[str, int | None]:
    """Ids of the roles packing and masking need: sep, pad, mask, and cls/unk if present.

    A tokenizer without a pad token (GPT-2's, say) pads with its separator: packed rows
    are always full, so pad only has to be a token that masking never chooses. A
    tokenizer without a mask token gets `mask: None` and can train a causal LM only.
    """
    found: dict[str, int | None] = {}
    for role, names in ROLE_NAMES.items():
        ids = [tok.token_to_id(name) for name in names]
        found[role] = next((i for i in ids if i is not None), None)
    if found["sep"] is None:
        raise DataError("the tokenizer has no document separator token; it needs one of "
                        + ", ".join(ROLE_NAMES["sep"]) + " (and ideally a pad and a mask token).")
    if found["pad"] is None:
        found["pad"] = found["sep"]
    for role in ("cls", "unk"):
        if found[role] is None:
            del found[role]
    return found
