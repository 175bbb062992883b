"""Attention rows from q and K: long inputs without an n × n map per layer.

In row mode (`trace.hooked(..., qk_rows=True)`, used by target-row streaming of causal LMs) the traced attention
function does not write α [B, H, n, n]. It computes the attention output with a memory-bounded kernel and keeps, per
layer, the softmax's log-normaliser per row (`lse`, [B, H, n]) next to q and K, so that any rows of α can be formed
later exactly as the eager softmax forms them:

    α^h_ij = exp(q^h_i · k^h_j · scaling (+ softcap) + mask_ij − lse^h_i),   lse^h_i = log Σ_j exp(…)

`QKRows.rows(positions)` gives those rows [B, H, K, n] in O(K · n) memory, `QKRows.diagonal()` the α^h_ii the per-token
quantities need. The output: on the CPU, torch's flash-attention kernel (it returns the log-normaliser); elsewhere,
or with a softcap, the eager formula in row blocks (`ROW_BLOCK_ELEMENTS` scores at a time). α is rounded to the model's
dtype as the eager code rounds it, then upcast to float32 for the methods.

Memory per layer kept: q [B, H, n, d_h] + K [B, H_kv, n, d_h] (the model's dtype) + lse [B, H, n] (float32); the
additive mask [B, 1, n, n] the model builds is shared by the layers (one per mask kind).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_BLOCK_ELEMENTS = 1 << 24  # scores held at once by the blocked path (64 MB of float32)


def _repeat(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, H_kv, n, d_h] → [B, H, n, d_h] (grouped-query attention shares key / value heads)."""
    rep = heads // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


@dataclass
class QKRows:
    """What one layer's attention needs to give any rows of its α (see the module docstring). Shapes: query
    [B, H, n, d_h] (after rotary embeddings / q-norm, as the attention function got it), key [B, H_kv, n, d_h], mask
    [B, 1, n, n] additive or None, lse [B, H, n] float32."""

    query: torch.Tensor
    key: torch.Tensor
    mask: torch.Tensor | None
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
            None if self.mask is None else self.mask[one],
            self.scaling,
            self.softcap,
            self.lse[one],
            self.causal,
            None if self.row_scale is None else self.row_scale[one],
        )

    @property
    def heads(self) -> int:
        return self.query.shape[1]

    def _scores(self, q: torch.Tensor, rows: torch.Tensor | None, end: int | None = None) -> torch.Tensor:
        """Scores of query rows q [B, H, K, d_h] against the keys before `end` (None: all), as eager computes them,
        masked: [B, H, K, end]. Grouped-query heads are matched to their key head by a view, not a copy."""
        key = self.key if end is None else self.key[:, :, :end]
        b, h, k, dh = q.shape
        kv = key.shape[1]
        s = torch.matmul(q.reshape(b, kv, (h // kv) * k, dh), key.transpose(2, 3)).view(b, h, k, -1) * self.scaling
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        if self.mask is not None:
            m = self.mask[..., : s.shape[-1]].expand(b, -1, -1, -1)
            s = s + (m if rows is None else _take_rows(m, rows))
        return s

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """α at target positions rows [B, K]: [B, H, K, n] float32 (rounded to the model's dtype first). A causal
        layer computes only the sources up to the last row asked (the others are 0)."""
        n = self.key.shape[2]
        end = int(rows.max()) + 1 if self.causal and rows.numel() else n
        s = self._scores(_take_rows(self.query, rows), rows, end).float()
        lse = self.lse.gather(2, rows[:, None, :].expand(-1, self.heads, -1))
        a = torch.exp(s.sub_(lse[..., None])).to(self.query.dtype).float()
        if self.row_scale is not None:
            a = a / self.row_scale.gather(1, rows)[:, None, :, None]
        return a if end == n else torch.nn.functional.pad(a, (0, n - end))

    def diagonal(self) -> torch.Tensor:
        """α^h_ii for every position: [B, H, n] float32."""
        key = _repeat(self.key, self.heads)
        s = (self.query.float() * key.float()).sum(-1) * self.scaling
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        if self.mask is not None:
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
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, QKRows]:
    """The attention output [B, n, H, d_h] (the layout eager attention returns) and the `QKRows` of this call,
    without an [B, H, n, n] tensor. query [B, H, n, d_h], key and value [B, H_kv, n, d_h], mask additive [B, 1, n, n]
    (or None: no mask); `causal`: the mask hides every later source (a causal LM's)."""
    heads = query.shape[1]
    v = _repeat(value, heads)
    if _use_flash(query, softcap):
        m = None if mask is None else mask.to(query.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, _repeat(key, heads), v, 0.0, False, attn_mask=m, scale=scaling
        )
        out = out.transpose(1, 2).contiguous()
    else:
        out, lse = _blocked(query, key, v, mask, scaling, softcap)  # query heads matched to key heads by a view
    return out, QKRows(query, key, mask, scaling, softcap, lse.float(), causal)


def _use_flash(query: torch.Tensor, softcap: float | None) -> bool:
    """Whether torch's CPU flash-attention kernel computes this call (it has no softcap)."""
    return query.device.type == "cpu" and softcap is None


def _blocked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention in blocks of query rows: (output [B, n, H, d_h], lse [B, H, n] float32)."""
    b, h, n, _ = query.shape
    step = max(1, ROW_BLOCK_ELEMENTS // max(1, b * h * n))
    out = query.new_empty(b, n, h, value.shape[-1])
    lse = torch.empty(b, h, n, dtype=torch.float32, device=query.device)
    probe = QKRows(query, key, mask, scaling, softcap, lse)
    for s in range(0, n, step):
        e = min(n, s + step)
        rows = torch.arange(s, e, device=query.device).expand(b, -1)
        scores = probe._scores(query[:, :, s:e], rows).float()
        lse[:, :, s:e] = torch.logsumexp(scores, -1)
        alpha = torch.exp(scores - lse[:, :, s:e, None]).to(query.dtype)
        out[:, s:e] = torch.matmul(alpha, value).transpose(1, 2)
    return out, lse


def kept_bytes(n_layers: int, batch: int, n: int, heads: int, kv_heads: int, d_head: int, itemsize: int) -> int:
    """Bytes the `QKRows` of every layer hold (q, K, lse; the shared mask not counted)."""
    per_layer = batch * n * d_head * (heads + kv_heads) * itemsize + batch * heads * n * 4
    return n_layers * per_layer
