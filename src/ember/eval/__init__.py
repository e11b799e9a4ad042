"""Evaluation of trained runs: held-out loss (`ember eval lm`) and GLUE fine-tuning
(`ember eval glue`). Everything starts from a run directory (see `run.open_run`)."""
