"""Plain PyTorch modules: the Transformer for masked and causal language modelling.
No torch.distributed here; parallelism is applied from outside (ember.parallel)."""

from ember.model.transformer import Transformer

__all__ = ["Transformer"]
