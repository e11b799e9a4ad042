"""A model built on the meta device is sized before it is allocated: too big for the memory
left on the device is a ConfigError, and only the allocator's out-of-memory becomes one."""

import pytest
import torch

import ember.parallel.materialize as materialize
from ember.config import ModelConfig
from ember.errors import ConfigError
from ember.model import Transformer

CFG = ModelConfig(vocab_size=64, hidden=32, layers=2, heads=2, mlp_hidden=64, max_seq_len=16)


def _meta_model():
    with torch.device("meta"):
        return Transformer(CFG)


def test_bytes_are_the_weights_and_buffers_plus_one_whole_value():
    model = _meta_model()
    weights = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    largest = max(p.numel() * 4 for p in model.parameters())
    assert materialize.materialized_bytes(model) == weights + buffers + largest


def test_too_little_memory_is_refused_before_allocating(monkeypatch):
    model = _meta_model()
    need = materialize.materialized_bytes(model)
    monkeypatch.setattr(materialize, "available_memory_bytes", lambda device: need - 1)
    with pytest.raises(ConfigError, match="the model does not fit"):
        materialize.materialize(model, CFG, 0, torch.device("cpu"))
    assert materialize.is_meta(model)  # nothing was allocated
    monkeypatch.setattr(materialize, "available_memory_bytes", lambda device: need)
    materialize.materialize(model, CFG, 0, torch.device("cpu"))
    assert not materialize.is_meta(model)


@pytest.mark.parametrize("error, refused", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory"), True),
    (RuntimeError("some other failure"), False),
])
def test_only_out_of_memory_becomes_the_refusal(monkeypatch, error, refused):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(materialize, "available_memory_bytes", lambda device: None)
    monkeypatch.setattr(materialize, "init_weights", fail)
    with pytest.raises(ConfigError if refused else RuntimeError) as caught:
        materialize.materialize(_meta_model(), CFG, 0, torch.device("cpu"))
    assert refused == isinstance(caught.value, ConfigError)
    assert refused == ("does not fit" in str(caught.value))
