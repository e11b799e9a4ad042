"""The `ember export` verbs: `hf` (Hugging Face transformers folder)."""

from __future__ import annotations


def _cmd_hf(args) -> int:
    from ember.export.hf import export_hf

    done = export_hf(args.checkpoint, args.out, tokenizer=args.tokenizer)
    print(f"wrote {done['architecture']} ({done['parameters']:,} parameters, vocabulary {done['vocab_size']:,} "
          f"padded from the tokenizer's {done['tokenizer_vocab_size']:,}) to {done['out']}")
    return 0


def register_export(verbs) -> None:
    """Add `ember export hf` to the top-level subparsers."""
    export = verbs.add_parser("export", help="write a run in another format").add_subparsers(
        dest="export_verb", required=True)
    hf = export.add_parser("hf", help="a transformers folder (causal LMs as Llama or GPT-2; masked LMs as "
                                           "remote code, trust_remote_code=True)")
    hf.add_argument("--checkpoint", required=True, help="run directory (or one of its checkpoints/step_* folders)")
    hf.add_argument("--out", required=True, help="folder to create; loads with AutoModelForCausalLM (causal) or "
                                                "AutoModelForMaskedLM (masked, trust_remote_code=True)")
    hf.add_argument("--tokenizer", help="tokenizer.json (default: the one in the run directory)")
    hf.set_defaults(func=_cmd_hf)
