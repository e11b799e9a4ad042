"""Token rows -> what a step feeds the model: (inputs, labels) on the device and the
number of targets, counted on the host so that no step waits for the GPU to report it."""

from __future__ import annotations

import torch

from ember.config import Config
from ember.data import make_targets


class Inputs:
    def __init__(self, cfg: Config, manifest: dict, device: torch.device):
        self.cfg, self.manifest, self.device = cfg, manifest, device

    def __call__(self, ids: torch.Tensor, seed: int, first_row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        inputs, labels = make_targets(ids, self.cfg.model.objective, self.cfg.data,
                                      self.manifest["special_tokens"], self.manifest["vocab_size"], seed, first_row)
        count = int((labels != -100).sum())
        return self.to_device(inputs), self.to_device(labels), count

    def to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)
