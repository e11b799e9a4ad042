"""Text to packed token shards, and shards to training batches.

`prepare` writes a folder (tokenizer.json, train_*.npy, val_*.npy, manifest.json);
`load_manifest` checks one; `Batches` reads it in a resumable seeded order;
`make_targets` turns ids into (inputs, labels) for either objective.

The names that need torch (Batches, make_targets, held_out_seed) are imported on first
use, so preparation's worker processes start without importing torch.
"""

from ember.data.corpus import write_stdlib_corpus
from ember.data.errors import DataError
from ember.data.manifest import load_manifest
from ember.data.prepare import prepare
from ember.data.sources import iter_documents
from ember.data.tokenizer import load_tokenizer, special_token_ids, train_tokenizer

_LAZY = {"Batches": "ember.data.loader", "held_out_seed": "ember.data.targets", "make_targets": "ember.data.targets"}

__all__ = ["Batches", "DataError", "iter_documents", "load_manifest", "load_tokenizer",
           "held_out_seed", "make_targets", "prepare", "special_token_ids", "train_tokenizer", "write_stdlib_corpus"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ember.data' has no attribute {name!r}")
