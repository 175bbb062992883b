"""The engine keeps weight-derived tensors per layer (`methods.norms._weights`) and float32 copies of low-precision
weights (`adapters.float32`), keyed by address and version. A weight replaced by another tensor that lands at the same
address with the same version counter (a freed tensor's memory reused) must not be served from the cache."""

from __future__ import annotations

import torch

import mixlens
from mixlens.adapters import float32
from mixlens.methods import norms
from tests.conftest import random_model


def _same_place(held: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A new tensor object over `held`'s memory, holding `values` (written without bumping any version counter), its
    version counter brought to `held`'s: the address and version of `held`, other content."""
    held.detach().numpy()[...] = values.numpy()  # numpy writes: no version bump
    other = torch.from_numpy(held.detach().numpy())
    with torch.no_grad():
        while other._version < held._version:
            other.add_(0)
    assert other.data_ptr() == held.data_ptr() and other._version == held._version and other is not held
    return other


def test_a_replaced_w_o_at_the_same_address_and_version_is_read_again(tokenizer):
    lens = mixlens.Lens(random_model("gpt2", tokenizer), tokenizer)
    lay = lens.adapter.layers[0]
    first = torch.from_numpy(lay.raw_w_o.detach().clone().numpy())
    lay.raw_w_o = first
    before = norms._weights(lay, 0).w_c.clone()
    lay.raw_w_o = _same_place(first, first * 2)
    after = norms._weights(lay, 0).w_c
    norms._WEIGHTS.clear()
    assert not torch.equal(after, before)
    assert torch.equal(after, norms._weights(lay, 0).w_c)


def test_a_replaced_low_precision_weight_is_upcast_again():
    cache: dict = {}
    first = torch.ones(4, 4)
    half = first.to(torch.float16)  # float32() caches the upcast of a non-float32 tensor
    assert torch.equal(float32(half, cache, "w"), first)
    other = torch.empty(0, dtype=torch.float16).set_(half.untyped_storage(), 0, half.shape, half.stride())
    with torch.no_grad():
        half.view(torch.int16).numpy()[...] = (first * 3).to(torch.float16).view(torch.int16).numpy()
        while other._version != half._version:  # set_ counted as a write on `other`
            (other if other._version < half._version else half).add_(0)
    cache["w"] = (cache["w"][0][:1] + (half._version,) + cache["w"][0][2:], *cache["w"][1:])  # as if cached now
    assert other.data_ptr() == half.data_ptr() and other._version == half._version
    assert torch.equal(float32(other, cache, "w"), first * 3)
