"""The training loop, budget-keyed schedules, checkpoints and metrics."""
