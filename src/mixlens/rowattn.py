"""Attention rows from q and K: long inputs without an n × n map per layer.

In row mode (`trace.hooked(..., qk_rows=True)`, used by row streaming of causal LMs) the traced attention
function does not write α [B, H, n, n]. It computes the attention output with a memory-bounded kernel and keeps, per
layer, the softmax's log-normaliser per row (`lse`, [B, H, n]) next to q and K, so that any rows of α can be formed
later exactly as the eager softmax forms them:

    α^h_ij = exp(q^h_i · k^h_j · scaling (+ softcap) + mask_ij − lse^h_i),   lse^h_i = log Σ_j exp(…)

`QKRows.rows(positions)` gives those rows [B, H, K, n] in O(K · n) memory, `QKRows.diagonal()` the α^h_ii the per-token
quantities need. The output: on the CPU, torch's flash-attention kernel (it returns the log-normaliser); elsewhere,
or with a softcap, the eager formula in row blocks (`ROW_BLOCK_ELEMENTS` scores at a time). The scores are formed in
float32 on both paths and when rows are formed again (as the flash kernel accumulates them, whatever the model's
dtype); α is rounded to the model's dtype as the eager code rounds it, then upcast to float32 for the methods. So the
rows of α a method gets are the ones the output was computed from, to the model dtype's rounding of α itself.

Memory per layer kept: q [B, H, n, d_h] + K [B, H_kv, n, d_h] (the model's dtype) + lse [B, H, n] (float32).

The mask. transformers builds the eager attention's mask as floats [B, 1, n, n] (at 32,768 tokens 4 GiB, one per
mask kind: Gemma 3 has two). In row mode the model gets a `LazyMask` instead (`mask_interface`, registered as the
eager mask while a row-mode trace runs): transformers' own index-based mask function, evaluated on the blocks of
rows and columns a kernel asks for. A mask that is only causal (no padding, no window) runs the flash kernel with
`is_causal` (the upper triangle skipped); any other (a sliding window, padding) runs the row blocks, each over the
columns its rows can see (a window of w: O(n · w) per layer, not O(n²)).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

ROW_BLOCK_ELEMENTS = 1 << 24  # scores held at once by the blocked path (64 MB of float32)


def _repeat(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, H_kv, n, d_h] → [B, H, n, d_h] (grouped-query attention shares key / value heads)."""
    rep = heads // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


@dataclass(frozen=True)
class LazyMask:
    """An additive attention mask [B, 1, q_length, kv_length] kept as the mask function transformers would fill it
    from, `fn(batch_idx, head_idx, q_idx, kv_idx) → bool` (index-based, broadcasting; padding folded in). `batch`:
    the batch indices the mask function knows each row by (`of_input` keeps one); `causal_only`: the mask is the
    causal one and nothing else, so a kernel may take `is_causal` instead."""

    fn: Callable[..., torch.Tensor]
    batch: torch.Tensor  # [B]
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    dtype: torch.dtype
    causal_only: bool

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.batch), 1, self.q_length, self.kv_length)

    def allowed(self, rows: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Where target rows [B, K] (query positions) may attend to sources start..end-1: [B, 1, K, end − start]."""
        dev = rows.device
        b = self.batch.to(dev)[:, None, None, None]
        q = (rows + self.q_offset)[:, None, :, None]
        kv = torch.arange(start, end, device=dev)[None, None, None, :] + self.kv_offset
        out = self.fn(b, torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev), q, kv)
        return out.expand(len(self.batch), 1, rows.shape[1], end - start)

    def block(self, rows: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The additive mask (0 or the dtype's minimum, as transformers' eager mask) of `allowed`."""
        ok = self.allowed(rows, start, end)
        return torch.zeros((), dtype=self.dtype, device=ok.device).masked_fill(~ok, torch.finfo(self.dtype).min)

    def first_column(self, rows: torch.Tensor, end: int) -> int:
        """The first source before `end` that any of rows [B, K] sees (end when none): the columns before it are
        masked for every row, so a kernel may skip them."""
        seen = self.allowed(rows, 0, end).flatten(0, 2).any(0).nonzero()
        return int(seen[0]) if len(seen) else end

    def diagonal(self) -> torch.Tensor:
        """The additive mask at (i, i) for every position: [B, n]."""
        i = torch.arange(self.q_length, device=self.batch.device)
        dev = self.batch.device
        ok = self.fn(
            self.batch[:, None],
            torch.zeros(1, 1, dtype=torch.long, device=dev),
            i[None] + self.q_offset,
            i[None] + self.kv_offset,
        ).expand(len(self.batch), self.q_length)
        return torch.zeros((), dtype=self.dtype, device=dev).masked_fill(~ok, torch.finfo(self.dtype).min)

    def dense(self) -> torch.Tensor:
        """The whole mask [B, 1, q_length, kv_length], as transformers' eager mask (for an attention that needs it:
        an edited layer)."""
        rows = torch.arange(self.q_length, device=self.batch.device).expand(len(self.batch), -1)
        return self.block(rows, 0, self.kv_length)

    def of_input(self, b: int) -> LazyMask:
        return replace(self, batch=self.batch[b : b + 1])


Mask = torch.Tensor | LazyMask


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> LazyMask | torch.Tensor | None:
    """transformers' eager mask as a `LazyMask` (its `AttentionMaskInterface` signature). A mask that needs vmap (a
    custom, not index-based function) is built the eager way."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        eager_mask,
        padding_mask_function,
        prepare_padding_mask,
    )

    fn: Callable[..., Any] = causal_mask_function if mask_function is None else mask_function
    if kwargs.get("use_vmap"):
        return eager_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset, fn, attention_mask, dtype, device=device, **kwargs
        )
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    local = kwargs.get("local_size")
    causal_only = (  # transformers' own test for SDPA's is_causal, on a pass without a cache
        bool(kwargs.get("allow_is_causal_skip"))
        and (padding is None or bool(padding.all()))
        and (local is None or kv_length < local)  # a window (or chunk) larger than the input: causal
        and q_offset == kv_offset == 0
        and q_length == kv_length
    )
    if padding is not None and not bool(padding.all()):  # no padding: the mask is the function alone
        fn = and_masks(fn, padding_mask_function(padding.bool()))
    batch = torch.arange(batch_size, device=device)
    return LazyMask(fn, batch, q_length, kv_length, q_offset, kv_offset, dtype, causal_only)


def dense_mask(mask: Any) -> Any:
    """A `LazyMask` filled ([B, 1, n_q, n_kv]); anything else as it is."""
    return mask.dense() if isinstance(mask, LazyMask) else mask


@dataclass
class QKRows:
    """What one layer's attention needs to give any rows of its α (see the module docstring). Shapes: query
    [B, H, n, d_h] (after rotary embeddings / q-norm, as the attention function got it), key [B, H_kv, n, d_h], mask
    [B, 1, n, n] additive, a `LazyMask`, or None, lse [B, H, n] float32."""

    query: torch.Tensor
    key: torch.Tensor
    mask: Mask | None
    scaling: float
    softcap: float | None
    lse: torch.Tensor
    causal: bool = False  # the mask hides every source after the target: rows need only the sources up to it
    row_scale: torch.Tensor | None = None  # [B, n]: rows of α divided by it (a sandwich norm's s^post_i)

    def of_input(self, b: int) -> QKRows:
        """Input b alone (views, no copy)."""
        one = slice(b, b + 1)
        return QKRows(
            self.query[one],
            self.key[one],
            None if self.mask is None else self.mask.of_input(b) if isinstance(self.mask, LazyMask) else self.mask[one],
            self.scaling,
            self.softcap,
            self.lse[one],
            self.causal,
            None if self.row_scale is None else self.row_scale[one],
        )

    @property
    def heads(self) -> int:
        return self.query.shape[1]

    def _scores(self, q: torch.Tensor, rows: torch.Tensor, end: int | None = None, start: int = 0) -> torch.Tensor:
        """Scores of query rows q [B, H, K, d_h] (at positions rows [B, K]) against the keys start..end-1 (end None:
        all), masked: [B, H, K, end − start] float32. Products and sums in float32 whatever the model's dtype, as the
        flash kernel forms them: scores rounded to bfloat16 (eager's matmul in the model's dtype) would be off by up
        to 2⁻⁹ of their size, which in the exponent makes α's rows miss the output the kernel computed (by a quarter
        of the attention output on Qwen2.5's first layer, whose scores reach the hundreds). Grouped-query heads are
        matched to their key head by a view, not a copy."""
        end = self.key.shape[2] if end is None else end
        key = self.key[:, :, start:end].float()
        b, h, k, dh = q.shape
        kv = key.shape[1]
        s = torch.matmul(q.float().reshape(b, kv, (h // kv) * k, dh), key.transpose(2, 3)).view(b, h, k, -1)
        s.mul_(self.scaling)  # in place: the block of scores is the largest tensor here
        if self.softcap is not None:
            s = torch.tanh(s.div_(self.softcap)).mul_(self.softcap)
        if isinstance(self.mask, LazyMask):
            s.add_(self.mask.block(rows, start, end))
        elif self.mask is not None:
            s.add_(_take_rows(self.mask[..., start:end].expand(b, -1, -1, -1), rows))
        return s

    def _start(self, rows: torch.Tensor, end: int) -> int:
        """The first source any of rows [B, K] sees (a lazy mask's window; else 0). Rows that see nothing (padding
        rows past a window) keep one column, so that their normaliser stays finite."""
        if not isinstance(self.mask, LazyMask) or self.mask.causal_only:
            return 0
        return max(0, min(self.mask.first_column(rows, end), end - 1))

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """α at target positions rows [B, K]: [B, H, K, n] float32 (rounded to the model's dtype first). A causal
        layer computes only the sources up to the last row asked (the others are 0)."""
        n = self.key.shape[2]
        end = int(rows.max()) + 1 if self.causal and rows.numel() else n
        start = self._start(rows, end)
        s = self._scores(_take_rows(self.query, rows), rows, end, start)
        lse = self.lse.gather(2, rows[:, None, :].expand(-1, self.heads, -1))
        a = s.new_empty(*s.shape[:3], n)  # written in place: the columns outside start..end-1 are 0, not copied
        a[..., :start] = 0
        a[..., end:] = 0
        inner = torch.exp(s.sub_(lse[..., None]), out=a[..., start:end])
        if self.query.dtype != torch.float32:  # rounded to the model's dtype, as eager's softmax output is
            inner.copy_(inner.to(self.query.dtype))
        if self.row_scale is not None:
            inner.div_(self.row_scale.gather(1, rows)[:, None, :, None])
        return a

    def diagonal(self) -> torch.Tensor:
        """α^h_ii for every position: [B, H, n] float32."""
        key = _repeat(self.key, self.heads)
        s = (self.query.float() * key.float()).sum(-1) * self.scaling
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        if isinstance(self.mask, LazyMask):
            s = s + self.mask.diagonal()[:, None].float()
        elif self.mask is not None:
            s = s + self.mask.diagonal(dim1=2, dim2=3).float()
        a = torch.exp(s - self.lse).to(self.query.dtype).float()
        return a if self.row_scale is None else a / self.row_scale[:, None, :]


def _take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t [B, H, n, e] at positions rows [B, K] of its third axis: [B, H, K, e]."""
    b, h, _, e = t.shape
    return t.gather(2, rows[:, None, :, None].expand(b, h, rows.shape[1], e))


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Mask | None,
    scaling: float,
    softcap: float | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, QKRows]:
    """The attention output [B, n, H, d_h] (the layout eager attention returns) and the `QKRows` of this call,
    without an [B, H, n, n] tensor. query [B, H, n, d_h], key and value [B, H_kv, n, d_h], mask additive [B, 1, n, n],
    a `LazyMask`, or None (no mask); `causal`: the mask hides every later source (a causal LM's)."""
    heads = query.shape[1]
    v = _repeat(value, heads)
    lazy = isinstance(mask, LazyMask)
    if _use_flash(query, softcap) and (not lazy or mask.causal_only):  # type: ignore[union-attr]
        m = None if mask is None or lazy else mask.to(query.dtype)  # type: ignore[union-attr]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, _repeat(key, heads), v, 0.0, lazy, attn_mask=m, scale=scaling
        )
        out = out.transpose(1, 2).contiguous()
    else:
        out, lse = _blocked(query, key, v, mask, scaling, softcap, causal)  # heads matched to key heads by a view
    return out, QKRows(query, key, mask, scaling, softcap, lse.float(), causal)


def _use_flash(query: torch.Tensor, softcap: float | None) -> bool:
    """Whether torch's CPU flash-attention kernel computes this call (it has no softcap)."""
    return query.device.type == "cpu" and softcap is None


def _blocked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Mask | None,
    scaling: float,
    softcap: float | None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention in blocks of query rows: (output [B, n, H, d_h], lse [B, H, n] float32); with a `LazyMask`
    each block over the columns its rows see."""
    b, h, n, _ = query.shape
    step = max(1, ROW_BLOCK_ELEMENTS // max(1, b * h * n))
    out = query.new_empty(b, n, h, value.shape[-1])
    lse = torch.empty(b, h, n, dtype=torch.float32, device=query.device)
    probe = QKRows(query, key, mask, scaling, softcap, lse)
    for s in range(0, n, step):
        e = min(n, s + step)
        rows = torch.arange(s, e, device=query.device).expand(b, -1)
        end = e if causal else key.shape[2]  # a causal mask hides the later sources
        start = probe._start(rows, end)
        scores = probe._scores(query[:, :, s:e], rows, end, start)
        top = scores.amax(-1)  # [B, H, rows]
        alpha = torch.softmax(scores, -1)  # one pass of exponentials (logsumexp, then exp(s − lse), took two)
        del scores
        # α at the top score is exp(top − lse) ≥ 1 / n: the normaliser from it, to float32 rounding, with no more exp
        lse[:, :, s:e] = top - alpha.amax(-1).log()
        out[:, s:e] = torch.matmul(alpha.to(query.dtype), value[:, :, start:end]).transpose(1, 2)
    return out, lse


def kept_bytes(n_layers: int, batch: int, n: int, heads: int, kv_heads: int, d_head: int, itemsize: int) -> int:
    """Bytes the `QKRows` of every layer hold (q, K, lse; the shared mask not counted)."""
    per_layer = batch * n * d_head * (heads + kv_heads) * itemsize + batch * heads * n * 4
    return n_layers * per_layer
