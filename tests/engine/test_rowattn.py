"""Attention rows from q and K (`mixlens.rowattn`): the output and every row of α equal the eager formula, on both
kernels (flash on the CPU, blocked rows elsewhere or with a softcap), with GQA, padding and sliding windows."""

from __future__ import annotations

import pytest
import torch

from mixlens import rowattn
from mixlens.rowattn import attend
from mixlens.trace import repeat_kv


def _eager(q, k, v, mask, scaling, softcap):
    s = torch.matmul(q, repeat_kv(k, q.shape[1]).transpose(2, 3)) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    a = torch.softmax(s + mask, -1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(a, repeat_kv(v, q.shape[1])).transpose(1, 2), a


def _mask(b: int, n: int, window: int | None = None, lengths=None) -> torch.Tensor:
    i = torch.arange(n)
    ok = i[None, :] <= i[:, None]
    if window is not None:
        ok &= i[:, None] - i[None, :] < window
    ok = ok.expand(b, 1, n, n).clone()
    for k, m in enumerate(lengths or []):
        ok[k, :, :, m:] = False
        ok[k, :, m:, :] = i[None, :] <= i[m:, None]  # padding rows see real tokens, as transformers builds them
    return torch.zeros(b, 1, n, n).masked_fill(~ok, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("softcap", [None, 7.0])
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_rows_and_output_equal_eager_attention(softcap, blocked, window, monkeypatch):
    torch.manual_seed(0)
    b, h, kv, n, dh = 2, 6, 2, 11, 8
    q, k, v = torch.randn(b, h, n, dh), torch.randn(b, kv, n, dh), torch.randn(b, kv, n, dh)
    mask = _mask(b, n, window, lengths=[11, 7])
    if blocked:
        monkeypatch.setattr(rowattn, "ROW_BLOCK_ELEMENTS", 3 * b * h * n)  # several blocks of 3 rows
        monkeypatch.setattr(rowattn, "_use_flash", lambda query, softcap: False)
    out, qk = attend(q, k, v, mask, 0.3, softcap, causal=True)
    want_out, want_a = _eager(q, k, v, mask, 0.3, softcap)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    rows = torch.tensor([[10, 0, 4], [6, 2, 3]])
    got = qk.rows(rows)
    want = want_a.gather(2, rows[:, None, :, None].expand(b, h, 3, n))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(qk.diagonal(), want_a.diagonal(dim1=2, dim2=3), rtol=1e-5, atol=1e-6)
    early = torch.tensor([[1, 4], [0, 2]])  # a causal layer computes the sources up to the last row asked
    torch.testing.assert_close(qk.rows(early), want_a.gather(2, early[:, None, :, None].expand(b, h, 2, n)))


def test_bfloat16_rows_are_rounded_as_eager_rounds_them():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 4, 9, 8).bfloat16() for _ in range(3))
    mask = _mask(1, 9)
    out, qk = attend(q, k, v, mask, 0.35)
    want_out, want_a = _eager(q, k, v, mask.bfloat16(), 0.35, None)
    rows = torch.tensor([[8, 3]])
    got = qk.rows(rows)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want_a.float()[:, :, [8, 3]], rtol=2e-2, atol=4e-3)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=3e-2, atol=3e-2)


def test_freed_memory_is_released_only_for_long_inputs(monkeypatch):
    from mixlens import memory

    calls: list[int] = []
    monkeypatch.setattr(memory, "_trim", lambda: calls.append)
    memory.release(memory.LONG_TOKENS - 1)
    assert calls == []
    memory.release(memory.LONG_TOKENS)
    assert calls == [0]
    monkeypatch.setattr(memory, "_trim", lambda: None)  # no glibc: nothing to call
    memory.release(10**6)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("blocked", [False, True])
def test_the_lazy_mask_is_transformers_eager_mask_and_gives_the_same_attention(window, padding, blocked, monkeypatch):
    """A row-mode pass gets `LazyMask` where transformers builds [B, 1, n, n] floats: filled, it equals
    `eager_mask`; attention through it (flash with is_causal, or row blocks over each block's window) equals
    attention through the dense mask, rows and diagonal included."""
    from transformers.masking_utils import causal_mask_function, eager_mask, sliding_window_causal_mask_function

    torch.manual_seed(2)
    b, h, kv, n, dh = 2, 4, 2, 12, 8
    pad = torch.ones(b, n, dtype=torch.long)
    if padding == "right":
        pad[1, 8:] = 0
    elif padding == "left":
        pad[1, :5] = 0
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    kwargs = dict(mask_function=fn, attention_mask=None if padding is None else pad.bool(), allow_is_causal_skip=True)
    if window is not None:
        kwargs["local_size"] = window
    lazy = rowattn.mask_interface(b, n, n, **kwargs)
    dense = eager_mask(b, n, n, **kwargs)
    assert isinstance(lazy, rowattn.LazyMask) and lazy.shape == tuple(dense.shape)
    torch.testing.assert_close(lazy.dense(), dense, rtol=0, atol=0)
    assert lazy.causal_only == (window is None and padding is None)
    wide = rowattn.mask_interface(b, n, n, mask_function=sliding_window_causal_mask_function(n + 1), local_size=n + 1)
    assert not wide.causal_only  # transformers did not allow the skip
    wide = rowattn.mask_interface(
        b, n, n, mask_function=sliding_window_causal_mask_function(n + 1), local_size=n + 1, allow_is_causal_skip=True
    )
    assert wide.causal_only  # a window wider than the input is the causal mask
    if blocked:
        monkeypatch.setattr(rowattn, "ROW_BLOCK_ELEMENTS", 4 * b * h * n)  # blocks of 4 rows
        monkeypatch.setattr(rowattn, "_use_flash", lambda query, softcap: False)
    q, k, v = torch.randn(b, h, n, dh), torch.randn(b, kv, n, dh), torch.randn(b, kv, n, dh)
    out, qk = attend(q, k, v, lazy, 0.3, None, causal=True)
    want_out, want_a = _eager(q, k, v, dense, 0.3, None)
    real = pad.bool()[:, :, None].transpose(1, 2).squeeze(1)  # rows of padding positions are not compared
    torch.testing.assert_close(out[real], want_out[real], rtol=1e-5, atol=1e-5)
    rows = torch.tensor([[11, 0, 6], [7, 5, 6]])  # real tokens (padding rows are not explained)
    want = want_a.gather(2, rows[:, None, :, None].expand(b, h, 3, n))
    torch.testing.assert_close(qk.rows(rows), want, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(qk.lse).all() and torch.isfinite(qk.diagonal()).all()
    torch.testing.assert_close(
        qk.diagonal()[real[:, None].expand(-1, h, -1)],
        want_a.diagonal(dim1=2, dim2=3)[real[:, None].expand(-1, h, -1)],
        rtol=1e-5,
        atol=1e-6,
    )
    one = qk.of_input(1)
    torch.testing.assert_close(one.rows(rows[1:]), want[1:], rtol=1e-5, atol=1e-6)
    if window is not None:  # a block of late rows starts at its window, not at 0
        assert lazy.first_column(torch.tensor([[9, 10, 11]] * b), 12) == 9 - window + 1


@pytest.mark.parametrize("blocked", [False, True])
def test_bfloat16_rows_rebuild_the_output_they_came_from(blocked, monkeypatch):
    """In bfloat16 the rows of α a method gets, times v, give back the attention output the model went on with (to
    bfloat16's rounding), also where the scores are large: they are formed in float32 as the kernel formed them (in
    bfloat16, a score of 100 is off by up to 0.25, which moves α by a quarter)."""
    torch.manual_seed(2)
    b, h, kv, n, dh = 1, 4, 2, 40, 16
    q, k = (torch.randn(b, heads, n, dh).mul_(6).bfloat16() for heads in (h, kv))  # scores of tens
    v = (torch.randn(b, kv, n, dh) + 3).bfloat16()  # a part shared by every source (a bias): α's errors add up
    if blocked:
        monkeypatch.setattr(rowattn, "ROW_BLOCK_ELEMENTS", 5 * b * h * n)
        monkeypatch.setattr(rowattn, "_use_flash", lambda query, softcap: False)
    out, qk = attend(q, k, v, _mask(b, n).bfloat16(), 0.25, causal=True)
    rows = torch.arange(n)[None]
    alpha = qk.rows(rows)  # [B, H, n, n] float32
    assert alpha.abs().amax() > 0.5  # sharp rows: large scores
    rebuilt = torch.matmul(alpha, repeat_kv(v, h).float()).transpose(1, 2)
    size = out.float().abs().amax()
    assert (rebuilt - out.float()).abs().amax() <= 2e-2 * size  # bfloat16 rounding of α and of the output
    torch.testing.assert_close(qk.diagonal(), alpha.diagonal(dim1=2, dim2=3), rtol=0, atol=0)
