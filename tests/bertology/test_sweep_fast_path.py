"""The sweep's fast path (cached residual stream, layers ≥ l only, H + 1 stacked copies) against a naive full
forward pass of the real bundled model with the head disabled by a plain PyTorch hook on BertSelfAttention,
independent of mixlens' edit points: every ablation's sentence embeddings must agree to 1e-5."""

from __future__ import annotations

import pytest
import torch

from mixlens.bertology.sweep import sweep
from mixlens.bertology.tasks import StsTask
from tests.engine.test_interventions import GOLD, PAIRS


class RecordingSts(StsTask):
    """StsTask that keeps every `collect` result ([copies·B, d] pooled embeddings) in call order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[torch.Tensor] = []

    def collect(self, output, i: int) -> torch.Tensor:
        res = super().collect(output, i)
        self.calls.append(res)
        return res


def _naive(lens, inputs: dict[str, torch.Tensor], layer: int, heads: list[int], mode: str) -> torch.Tensor:
    """Mean-pooled last hidden state [B, d] of a full forward pass with `heads` of `layer` disabled: their
    context z^h (the BertSelfAttention output before W_O) ← 0 (zero) or ← the mean of the head's value vectors
    over the real keys (uniform)."""
    lay = lens.adapter.layers[layer]
    d_h = lay.d_head
    mask = inputs["attention_mask"][..., None].float()  # [B, n, 1]
    values: dict[str, torch.Tensor] = {}

    def keep_values(_m, _i, v: torch.Tensor) -> None:
        values["v"] = v  # [B, n, H·d_h]

    def replace(_m, _i, out: tuple) -> tuple:
        z = out[0].clone()  # [B, n, H·d_h]
        for h in heads:
            cols = slice(h * d_h, (h + 1) * d_h)
            if mode == "zero":
                z[..., cols] = 0
            else:
                z[..., cols] = (values["v"][..., cols] * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
        return (z, *out[1:])

    hooks = [lay.attn.value.register_forward_hook(keep_values), lay.attn.register_forward_hook(replace)]
    try:
        with torch.no_grad():
            hidden = lens.model(**inputs).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    return (hidden * mask).sum(1) / mask.sum(1)


@pytest.mark.parametrize("mode", ["uniform", "zero"])
def test_sweep_fast_path_equals_naive_forward(bundled, mode):
    task = RecordingSts(bundled, PAIRS[:4], GOLD[:4], batch_size=8)  # one batch of 8 sentences
    sweep(bundled, task, mode)
    n_layers, n_heads = bundled.adapter.n_layers, bundled.adapter.n_heads
    assert len(task.calls) == 1 + n_layers
    inputs = task.batches[0]
    b = inputs["input_ids"].shape[0]
    with torch.no_grad():
        plain = bundled.model(**inputs).last_hidden_state
    m = inputs["attention_mask"][..., None].float()
    torch.testing.assert_close(task.calls[0], (plain * m).sum(1) / m.sum(1), atol=1e-5, rtol=0)
    worst = 0.0
    for layer in range(n_layers):
        fast = task.calls[1 + layer].view(n_heads + 1, b, -1)  # copy k: head k disabled; copy H: the whole layer
        edge = layer in (0, n_layers - 1)  # every copy of the first and last layer; three of the others
        for k in range(n_heads + 1) if edge else (0, 2 * layer + 1, n_heads):
            want = _naive(bundled, inputs, layer, [k] if k < n_heads else list(range(n_heads)), mode)
            worst = max(worst, float((fast[k] - want).abs().max()))
            if k == n_heads or (layer, k) == (0, 9):  # the ablation must change something: the test can fail
                assert float((want - task.calls[0]).abs().max()) > 1e-3
    assert worst <= 1e-5
