"""The tokenizer files AutoTokenizer needs: the run's tokenizer.json unchanged, and a
tokenizer_config.json naming PreTrainedTokenizerFast and the special tokens by role.

The tokenizer has no post-processor (ember's packing inserts separators itself), so the
exported tokenizer of a causal LM adds no special tokens on encode, exactly as in
training. The document separator is the end-of-text token, and since every document in the
training data began right after one, it is also the beginning-of-text token.

A masked LM is exported for classification, which pools its first position, so its
tokenizer gains the post-processor that lays a sentence or a pair out as `ember eval glue`
does (eval/encode.py): `[CLS] a [SEP] b [SEP]`, or with `<sep>` in [CLS]'s place where the
tokenizer has none. The pair's second segment has token type 1, as BERT's tokenizers give
it; ember's model has no segment embedding and ignores it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer

ROLES = {"sep": ("sep_token", "eos_token", "bos_token"), "pad": ("pad_token",), "mask": ("mask_token",),
         "cls": ("cls_token",), "unk": ("unk_token",)}


def write_tokenizer(folder: Path, source: Path, tok: Tokenizer, special_tokens: dict, max_len: int,
                    masked: bool = False) -> None:
    shutil.copyfile(source, folder / "tokenizer.json")
    if masked and special_tokens.get("sep") is not None:
        from tokenizers.processors import TemplateProcessing

        sep = tok.id_to_token(special_tokens["sep"])
        first_id = special_tokens.get("cls", special_tokens["sep"])
        first = tok.id_to_token(first_id)
        exported = Tokenizer.from_file(str(source))
        exported.post_processor = TemplateProcessing(
            single=f"{first} $A {sep}", pair=f"{first} $A {sep} $B:1 {sep}:1",
            special_tokens=sorted({(first, first_id), (sep, special_tokens["sep"])}))
        exported.save(str(folder / "tokenizer.json"))
    specials = {}
    for role, names in ROLES.items():
        token_id = special_tokens.get(role)
        if token_id is not None:
            specials.update({name: tok.id_to_token(token_id) for name in names})
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, **specials}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
