"""`ember eval lm`: held-out loss, perplexity and token accuracy of a checkpoint on a
prepared dataset's validation split.

The sequences are the split's first ones in file order and MLM masks are the trainer's
held-out masks (a pure function of data seed and row), so two checkpoints, or a
checkpoint and its own training log, are scored on exactly the same targets: with the
run's micro-batch and eval_batches, the loss equals the trainer's last held-out loss.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ember.config import ConfigError
from ember.data import Batches, DataError, held_out_seed, load_manifest, make_targets
from ember.data.manifest import has_document_boundaries, verify_checksums
from ember.eval.run import Run, open_run
from ember.device import autocast, autocast_dtype, device_name, pick_device

IGNORE = -100


def check_data(run, manifest: dict, data_dir: Path) -> None:
    """Refuse data the model cannot read or was not trained to read, in one sentence."""
    m = run.config.model
    if int(manifest["vocab_size"]) > m.vocab_size:
        raise ConfigError(f"the data in {data_dir} has a vocabulary of {manifest['vocab_size']} but the model "
                          f"knows {m.vocab_size} tokens; evaluate on data prepared with the run's tokenizer.json.")
    trained_on = run.data.get("tokenizer_sha256")
    if trained_on and manifest.get("tokenizer_sha256") and manifest["tokenizer_sha256"] != trained_on:
        raise ConfigError(f"the data in {data_dir} was tokenized with another tokenizer than the run's; prepare "
                          f"it with --tokenizer {run.run_dir / 'tokenizer.json'}.")
    if int(manifest["seq_len"]) > m.max_seq_len:
        raise ConfigError(f"the data's sequences ({manifest['seq_len']} tokens) are longer than the model's "
                          f"max_seq_len ({m.max_seq_len}); prepare it with --seq-len {m.max_seq_len}.")
    if m.objective == "mlm" and manifest["special_tokens"].get("mask") is None:
        raise ConfigError(f"the data in {data_dir} has no mask token, so a masked LM cannot be scored on it.")
    if run.config.data.document_mask and not has_document_boundaries(manifest):
        raise ConfigError(f"the run was trained with data.document_mask=true but the data in {data_dir} has no "
                          f"document boundaries; prepare it with --doc-boundaries.")


@torch.no_grad()
def evaluate_lm(checkpoint: str | Path | Run, data_dir: str | Path, batches: int | None = None,
                batch_size: int | None = None, device: str = "auto") -> dict:
    """Mean loss per target, its perplexity and argmax accuracy over the targets."""
    run = checkpoint if isinstance(checkpoint, Run) else open_run(checkpoint)
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    check_data(run, manifest, data_dir)
    cfg = run.config
    batch_size = cfg.train.micro_batch if batch_size is None else batch_size  # 0 is a mistake, not "default"
    if batch_size < 1 or (batches is not None and batches < 1):
        raise ConfigError("--batches and --batch-size must be at least 1.")
    val = Batches(data_dir, manifest, "val", seed=cfg.data.seed, documents=cfg.data.document_mask)
    if len(val) == 0:
        raise DataError(f"the data in {data_dir} has no held-out sequences; prepare it with --val-fraction > 0.")
    if cfg.data.verify:
        verify_checksums(data_dir, manifest, splits=("val",))
    # The run's attention: per document (docs) or not (None).
    ids, docs = val.fixed(len(val) if batches is None else batches * batch_size)
    if len(ids) and int(ids.max()) >= cfg.model.vocab_size:  # a damaged shard with a matching checksum
        raise DataError(f"the held-out data in {data_dir} holds the token id {int(ids.max())}, beyond the "
                        f"model's vocabulary of {cfg.model.vocab_size}; prepare the data again.")
    dev = pick_device(device, "--device")
    amp_dtype = autocast_dtype(cfg.train.precision, dev)
    model = run.build_model(device=dev).eval()
    loss_sum, correct, targets = 0.0, 0, 0
    for start in range(0, len(ids), batch_size):
        # The trainer's held-out masks: rows numbered from the split's start.
        inputs, labels = make_targets(ids[start:start + batch_size], cfg.model.objective, cfg.data,
                                      manifest["special_tokens"], manifest["vocab_size"],
                                      held_out_seed(cfg.data.seed), start)
        inputs, labels = inputs.to(dev), labels.to(dev)
        documents = None if docs is None else docs[start:start + batch_size].to(dev)
        keep = labels != IGNORE
        with autocast(dev, amp_dtype):
            # Only labelled positions reach the output layer, as in sparse prediction.
            logits = model.head(model.norm(model.trunk(inputs, document_ids=documents)[keep])).float()
        loss_sum += float(F.cross_entropy(logits, labels[keep], reduction="sum"))
        correct += int((logits.argmax(-1) == labels[keep]).sum())
        targets += int(keep.sum())
    loss = loss_sum / max(targets, 1)
    return {"checkpoint": str(run.run_dir), "weights": str(run.weights), "data": str(data_dir),
            "objective": cfg.model.objective, "sequences": len(ids), "targets": targets,
            "loss": loss, "perplexity": math.exp(min(loss, 700.0)), "accuracy": correct / max(targets, 1),
            "unigram_entropy": manifest.get("unigram_entropy"), "device": device_name(dev)}
