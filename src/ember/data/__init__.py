"""Text to packed token shards, and shards to training batches.

`prepare` writes a folder (tokenizer.json, train_*.npy, val_*.npy, manifest.json);
`load_manifest` checks one; `Batches` reads it in a resumable seeded order;
`make_targets` turns ids into (inputs, labels) for either objective.
"""

from ember.data.corpus import write_stdlib_corpus
from ember.data.errors import DataError
from ember.data.loader import Batches
from ember.data.manifest import load_manifest
from ember.data.prepare import prepare
from ember.data.sources import iter_documents
from ember.data.targets import held_out_seed, make_targets
from ember.data.tokenizer import load_tokenizer, special_token_ids, train_tokenizer

__all__ = ["Batches", "DataError", "iter_documents", "load_manifest", "load_tokenizer",
           "held_out_seed", "make_targets", "prepare", "special_token_ids", "train_tokenizer", "write_stdlib_corpus"]
