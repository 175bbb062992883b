"""Norm-based decomposition of the attention block (Kobayashi et al. 2020, 2021; DESIGN §3.2–3.4): the fast engine.

Per layer, with f^h(x_j) = v^h_j W_O^h and u_ij = Σ_h α^h_ij f^h(x_j):

- N       ‖α^h_ij f^h(x_j)‖ per head, ‖u_ij‖ head-summed
- N-Res   ‖t_ij‖,        t_ij = u_ij + [i=j] x_i
- N-ResLN ‖g_i(t_ij)‖,   g_i(v) = γ ⊙ C(v) / s_i, s_i from the real pre-norm vector

`methods.reference` defines the same quantities with explicit vectors. Here norms of linear images are taken through
per-source Gram matrices (DESIGN §4), never through [head, target, source, d] tensors, by two passes per layer: a
token pass (Gram matrices, diagonals, ratios, scale, reconstruction errors) and an attention pass (the maps). Each
exists compiled for the CPU (`_compiled` driving the numba kernels of `_kernels`) and in plain torch for any device
(`_torch_passes`); both read the named structures of `_kernels`, built here. Every call checks that the decomposition
sums back to the real pre-norm vector and norm output of each layer, and raises `ReconstructionError` naming the
layer if not.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from mixlens.adapters import Adapter, Layer
from mixlens.errors import MixlensError, ReconstructionError
from mixlens.methods import _compiled, _torch_passes
from mixlens.methods._kernels import LayerInputs, LayerWeights, Layout, Maps, TokenResults, kernel_args
from mixlens.methods._torch_passes import quad_norm, quad_norms
from mixlens.methods.attention import ALPHA_MEAN, rows_of, target_alpha
from mixlens.methods.memo import PairRows, memo_of
from mixlens.methods.registry import LHTS, TRACED, Card, register
from mixlens.trace import LayerTrace, Trace, repeat_kv

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("api.md", "the Kobayashi methods")

__all__ = [
    "ATTN_TOLERANCES",
    "RATIO_VARIANTS",
    "TOLERANCE",
    "TOLERANCES",
    "BlockNorms",
    "NormRun",
    "attn_row_size",
    "attn_sum",
    "attn_tolerance",
    "block_norms",
    "head_vectors",
    "norm",
    "norm_res",
    "norm_resln",
    "pair_rows",
    "quad_norm",
    "quad_norms",
    "row_error",
    "stream_layer",
    "tolerance",
]

RATIO_VARIANTS = ("W", "N", "Res-W", "Res-N", "ResLN-N")
TOLERANCE = 1e-4  # max abs error, relative to max(1, |real output|), of a forward pass in float32
# ... and of a forward pass in another dtype (`mixlens.load(dtype=...)`): its own rounding, measured in
# docs/guides/your-model.md
TOLERANCES = {torch.float32: TOLERANCE, torch.bfloat16: 2e-2, torch.float16: 2.5e-3}
# ... and, in those dtypes, the error of the attention output's decomposition relative to its own size (the stream
# dwarfs a wrong attention output: W_O scaled by 1.1 moves the check above by less than bfloat16's rounding)
ATTN_TOLERANCES = {torch.bfloat16: 5e-2, torch.float16: 6e-3}
PROBES = 4  # random directions of the per-run decomposition check
CHECK_ROWS = 4  # seeded random rows per input that the per-row attention check adds to the computed target rows
CHECK_SEED = 0  # their seed (the same rows for the same lengths)
ROW_FLOOR = 1e-6  # the per-row checks' denominator floor, as a share of the row's residual stream
ROUNDINGS = 5  # the model's rounding of its attention output allowed in the per-row check, in roundoffs of its dtype
TOKEN_BLOCK = 128  # tokens per block of head vectors C f (compiled: per job, its C f stays in one core's cache)
COMPILED = True  # CPU: the numba passes of `_kernels`; False (and other devices): the plain torch passes


def run_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a model's forward pass runs in (its parameters')."""
    return next(model.parameters()).dtype


def tolerance(model: torch.nn.Module, float32: float = TOLERANCE) -> float:
    """The tolerance of an exactness check on a forward pass of `model`: `float32` (the check's own tolerance) for
    a float32 model, else the larger of it and the rounding tolerance of the model's dtype (`TOLERANCES`)."""
    dtype = run_dtype(model)
    return float32 if dtype == torch.float32 else max(float32, TOLERANCES.get(dtype, TOLERANCES[torch.float16]))


def attn_tolerance(model: torch.nn.Module) -> float:
    """The tolerance of the per-row attention-output check on a forward pass of `model`, relative to each row's own
    size: `TOLERANCE` for a float32 model, else the attention tolerance of its dtype (`ATTN_TOLERANCES`)."""
    dtype = run_dtype(model)
    return TOLERANCE if dtype == torch.float32 else ATTN_TOLERANCES.get(dtype, ATTN_TOLERANCES[torch.float16])


def row_error(rebuilt: torch.Tensor, real: torch.Tensor, size: torch.Tensor | None = None) -> torch.Tensor:
    """‖rebuilt − real‖ / size per row (the last axis): [..., d] → [...]; `size` [...] defaults to ‖real‖. The
    relative error of each row against its own size, never against the largest row (a NaN anywhere gives NaN, which
    fails a check)."""
    size = real.float().norm(dim=-1) if size is None else size
    return (rebuilt.float() - real.float()).norm(dim=-1) / size.clamp_min(torch.finfo(torch.float32).tiny)


def attn_row_size(
    real: torch.Tensor, b_o: torch.Tensor | None, stream: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The size [...] an attention output's row error is measured against, from the real output [..., d]: its part
    the decomposition gives to tokens, ‖o_i − b_O‖; at least `ROUNDINGS` roundoffs of `dtype` (the model's
    rounding is of the whole output, b_O included) per tolerance times ‖o_i‖; at least `ROW_FLOOR` of the row's
    residual stream [..., d]."""
    real = real.float()
    own = real.norm(dim=-1)
    attributed = own if b_o is None else (real - b_o.float()).norm(dim=-1)
    unit = torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0
    tol = TOLERANCE if dtype == torch.float32 else ATTN_TOLERANCES.get(dtype, ATTN_TOLERANCES[torch.float16])
    floor = ROW_FLOOR * stream.float().norm(dim=-1)
    return torch.maximum(torch.maximum(attributed, ROUNDINGS * unit / tol * own), floor)


def check_positions(mask: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """The rows [B, R] (int64) the per-row attention check covers: the target rows (row mode) or the last real token
    (full maps), then `CHECK_ROWS` positions per input drawn with a fixed seed among its real tokens."""
    lengths = mask.sum(-1).cpu()  # [B]
    gen = torch.Generator().manual_seed(CHECK_SEED)
    drawn = (torch.rand(len(lengths), CHECK_ROWS, generator=gen) * lengths[:, None]).long()  # [B, S] in [0, len)
    first = (lengths - 1).clamp_min(0)[:, None] if targets is None else targets.long().cpu()
    return torch.cat([first, drawn], 1).to(mask.device)


@torch.no_grad()
def attention_row_errors(lt: LayerTrace, lay: Layer, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention output rebuilt from the decomposition's pieces — α's rows (÷ s^post with a sandwich norm), v,
    W_O, b_O — at positions rows [B, R], against the model's own (run in `dtype`): [2, B, R] max abs error and error
    relative to the row's size (`attn_row_size`). Costs R rows of attention: α's rows (from q and K in row mode),
    R·H·n·d_h for Σ_j α v and R·d² for W_O per input."""
    alpha = lt.alpha_rows(rows, mix=True)  # [B, H, R, n]
    z = torch.matmul(alpha, repeat_kv(lt.value, lay.n_heads).float())  # [B, H, R, d_h]
    rebuilt = z.transpose(1, 2).flatten(2) @ lay.w_o.float()  # [B, R, d]
    if lay.b_o is not None:
        rebuilt = rebuilt + lay.b_o.float()
    at = rows[:, :, None].expand(-1, -1, rebuilt.shape[-1])
    real = lt.attn_out.float().gather(1, at)
    size = attn_row_size(real, lay.b_o, lt.mix_in.float().gather(1, at), dtype)
    return torch.stack([(rebuilt - real).abs().amax(-1), row_error(rebuilt, real, size)])


@dataclass
class BlockNorms:
    """All norm-based quantities of a trace. B=batch, L=layer, H=head, n=tokens, d=hidden; padding is 0."""

    f_norm: torch.Tensor  # [B, L, H, n(source)]  ‖f^h(x_j)‖
    n: torch.Tensor  # [B, L, K(target), n(source)]  ‖u_ij‖; K = n, or the rows of `rows_of(trace)`
    n_res: torch.Tensor  # [B, L, K, n]  ‖t_ij‖
    n_resln: torch.Tensor  # [B, L, K, n]  ‖g_i(t_ij)‖
    ratio: dict[str, torch.Tensor]  # variant → [B, L, n(target)] context-mixing ratio r_i (every token)
    error: torch.Tensor  # [B, L] max abs reconstruction error (pre-norm sum and norm output)
    scale: torch.Tensor  # [B, L, n]  s_i of the norm after attention (0 at padding)
    bias_terms: torch.Tensor  # [L, 2, d]  P(b_O) and β per layer
    error_share: torch.Tensor | None = None  # [B, L] the error as a share of the check's tolerance (≤ 1: passed)

    @property
    def bias(self) -> torch.Tensor:
        """g_i(b_O) + β = P(b_O) / s_i + β, the part of the norm output no token owns: [B, L, n, d]."""
        real = self.scale > 0
        inv = torch.where(real, 1 / self.scale.clamp_min(torch.finfo(self.scale.dtype).tiny), 0)
        p_b, beta = self.bias_terms[:, 0], self.bias_terms[:, 1]
        return (p_b[:, None] * inv[..., None] + beta[:, None]) * real[..., None]


def head_vectors(lt: LayerTrace, lay: Layer) -> torch.Tensor:
    """f^h(x_j) = v^h_j W_O^h for every head and source: [B, H, n, d]."""
    v = repeat_kv(lt.value, lay.n_heads).float()
    w = lay.w_o.float().reshape(lay.n_heads, lay.d_head, -1)
    return torch.einsum("bhjk,hkd->bhjd", v, w)


def attn_sum(lt: LayerTrace, lay: Layer) -> torch.Tensor:
    """Σ_j Σ_h α^h_ij f^h(x_j) (the attention output without b_O): [B, n, d]."""
    z = torch.matmul(lt.alpha.float(), repeat_kv(lt.value, lay.n_heads).float())  # [B, H, n, d_h]
    return z.transpose(1, 2).flatten(2) @ lay.w_o.float()


# ---- the named structures of both passes, built here (see `_kernels` for the fields) ----


@dataclass
class RealTokens:
    """Where the T real tokens of a right-padded batch are."""

    mask: torch.Tensor  # [B, n] bool
    layout: Layout  # rows [T], offsets [B], lengths [B], targets [B, K] (int64)
    full: bool  # no padding at all
    all_rows: bool  # targets are every position (full maps)

    @classmethod
    def of(cls, mask: torch.Tensor, targets: torch.Tensor | None = None) -> RealTokens:
        m = mask.cpu().numpy()  # [B, n]: a few small arrays, cheaper in numpy than as torch calls
        lengths = m.sum(-1)
        positions = np.arange(m.shape[1])
        if not np.array_equal(positions < lengths[:, None], m):
            raise MixlensError("the norm decomposition needs right-padded batches (real tokens first)")
        offsets = np.cumsum(lengths) - lengths
        rows, offs, lens = (
            torch.from_numpy(a.astype(np.int64)).to(mask.device) for a in (m.ravel().nonzero()[0], offsets, lengths)
        )
        all_rows = targets is None
        if targets is None:
            targets = torch.from_numpy(np.tile(positions, (len(m), 1))).to(mask.device)
        layout = Layout(rows, offs, lens, targets.long().contiguous())
        return cls(mask, layout, bool(lengths.min() == m.shape[1]), all_rows)

    def with_targets(self, targets: torch.Tensor) -> RealTokens:
        """The same tokens with other target rows [B, K]."""
        return RealTokens(self.mask, self.layout._replace(targets=targets.long().contiguous()), self.full, False)

    def gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """[B·n, ...] → [T, ...] (`t` flattened over batch and tokens at `dim`)."""
        return t if self.full else t.index_select(dim, self.layout.rows)

    def scatter(self, t: torch.Tensor) -> torch.Tensor:
        """[T, ...] → [B, n, ...] with zeros at padding."""
        if self.full:
            return t.view(*self.mask.shape, *t.shape[1:])
        out = t.new_zeros(self.mask.numel(), *t.shape[1:])
        return out.index_copy_(0, self.layout.rows, t).view(*self.mask.shape, *t.shape[1:])


@dataclass
class Weights:
    """Weight-derived tensors of one layer's decomposition (kept by the engine per layer and weight version,
    `_WEIGHTS`; the adapter holds none)."""

    w_c: torch.Tensor  # [H, d_h, d]  W_O^h C (W_O^h for RMSNorm): C f^h = v^h w_c[h]
    bias_terms: torch.Tensor  # [2, d]  P(b_O), β
    consts: LayerWeights  # what the token pass needs

    @cached_property
    def kernel_consts(self) -> tuple:
        """`consts` as the compiled kernels take them (CPU tensors)."""
        return kernel_args(self.consts)


_WEIGHTS: dict[int, tuple[weakref.ref, tuple, Weights, tuple[weakref.ref, ...]]] = {}
# id(layer) → (the layer, weight version, Weights, the weight tensors it was built from)


def _weights(lay: Layer, index: int) -> Weights:
    norm, w_o = lay.ln_mix, lay.w_o
    key = (
        "norms",
        index,
        *(None if t is None else (t.data_ptr(), t._version) for t in (w_o, norm.weight, norm.bias, lay.b_o)),
    )
    sources = tuple(t for t in (w_o, norm.weight, norm.bias, lay.b_o) if t is not None)
    held = _WEIGHTS.get(id(lay))
    # a replaced weight freed and reallocated at the same address with the same version matches `key`: the weak
    # references tell the tensor objects apart
    if (
        held is None
        or held[0]() is not lay
        or held[1] != key
        or len(held[3]) != len(sources)
        or any(r() is not t for r, t in zip(held[3], sources, strict=True))
    ):
        h, d = lay.n_heads, w_o.shape[-1]
        w = w_o.detach().float().reshape(h, lay.d_head, d)  # [H, d_h, d]  W_O^h
        mean_w = w.new_empty(0, lay.d_head) if norm.rms else w.mean(-1)
        gen = torch.Generator().manual_seed(index)
        probes = (torch.randn(PROBES, d, generator=gen) / d**0.5).to(w.device)
        b_o = lay.b_o.detach().float() if lay.b_o is not None else w.new_zeros(d)
        gamma, beta = norm.weight.detach().float(), norm.shift().detach().float()
        consts = LayerWeights(
            mean_w=mean_w,
            gamma=gamma,
            gamma2=gamma.pow(2),
            beta=beta,
            b_o=b_o,
            probes=probes,
            w_probe=(probes @ w.reshape(h * lay.d_head, d).T).view(PROBES, h, lay.d_head).transpose(0, 1).contiguous(),
            eps=norm.eps,
            rms=norm.rms,
            identity=norm.identity,
        )
        weights = Weights(
            w_c=(w if norm.rms else w - mean_w[..., None]).contiguous(),
            bias_terms=torch.stack([norm.project(b_o).detach(), beta]),
            consts=consts,
        )
        gone = functools.partial(_WEIGHTS.pop, id(lay), None)  # the entry leaves with its layer
        held = (weakref.ref(lay, lambda _: gone()), key, weights, tuple(weakref.ref(t) for t in sources))
        _WEIGHTS[id(lay)] = held  # a new weight version replaces the stale one
    return held[2]


@dataclass
class LayerState:
    """One layer's inputs to the token pass and the attention pass (their results are row `index` of the run's
    `TokenResults`)."""

    index: int
    layer: Layer
    weights: Weights
    inputs: LayerInputs

    @cached_property
    def kernel_inputs(self) -> tuple:
        """`inputs` as the compiled kernels take them (CPU tensors)."""
        return kernel_args(self.inputs)

    @classmethod
    def of(cls, lt: LayerTrace, lay: Layer, tok: RealTokens, index: int) -> LayerState:
        alpha, alpha_at = _alpha_rows(lt, tok)
        v = lt.value.float().transpose(1, 2).flatten(0, 1)  # [B·n, H_kv, d_h] (a view: v is a transposed projection)
        v = repeat_kv(tok.gather(v), lay.n_heads)  # [T, H, d_h], token-major as projected: no copy without padding
        x, attn_out, mix_in, mix_out = (
            t.float().flatten(0, 1).contiguous() for t in (lt.x, lt.attn_out, lt.mix_in, lt.mix_out)
        )
        inputs = LayerInputs(
            alpha=alpha,
            alpha_at=alpha_at,
            alpha_diag=lt.alpha_diagonal(mix=True).contiguous(),
            v=v.contiguous(),
            x=x,
            attn_out=attn_out,
            mix_in=mix_in,
            mix_out=mix_out,
        )
        return cls(index, lay, _weights(lay, index), inputs)

    @classmethod
    def for_rows(cls, lt: LayerTrace, lay: Layer, tok: RealTokens, index: int) -> LayerState:
        """What the attention pass of `tok`'s target rows reads (α's rows; the token pass of this layer ran): a
        row-mode layer (`lt.qk`) with no per-token tensors, for a rollout's rows long after the forward pass."""
        alpha, alpha_at = _alpha_rows(lt, tok)
        none = alpha.new_empty(0)
        inputs = LayerInputs(alpha, alpha_at, none.view(0, 0, 0), none.view(0, 0, 0), *(none.view(0, 0),) * 4)
        return cls(index, lay, _weights(lay, index), inputs)


def _alpha_rows(lt: LayerTrace, tok: RealTokens) -> tuple[torch.Tensor, torch.Tensor]:
    """(α / s^post_i [B, H, R, n], alpha_at [B, n]) for the attention pass of `tok`'s target rows: α as traced
    (R = n), or in row mode only the target rows (R = K; alpha_at −1 elsewhere)."""
    b, n = tok.mask.shape
    if lt.qk is None:
        at = torch.arange(n, device=tok.mask.device).expand(b, n).contiguous()
        return lt.alpha_mix.float().contiguous(), at
    targets = tok.layout.targets
    at = torch.full((b, n), -1, dtype=torch.long, device=tok.mask.device)
    at.scatter_(1, targets, torch.arange(targets.shape[1], device=at.device).expand(b, -1).contiguous())
    return lt.alpha_rows(targets, mix=True).contiguous(), at


def _maps(
    b: int, n_layers: int, heads: int, n: int, rows: int, device: torch.device, written: bool, causal: bool
) -> Maps:
    """The output maps ([B, L, rows, n] for pairs), left uninitialised where the passes will write every cell
    (`written`: compiled, no padding; a causal upper triangle is never written)."""

    def alloc(*shape: int, every_cell: bool) -> torch.Tensor:
        return (torch.empty if every_cell else torch.zeros)(*shape, device=device)

    pair = [alloc(b, n_layers, rows, n, every_cell=written and not causal) for _ in range(4)]
    return Maps(
        f_norm=alloc(b, n_layers, heads, n, every_cell=written),
        ratio=alloc(len(RATIO_VARIANTS), b, n_layers, n, every_cell=written),
        scale=alloc(b, n_layers, n, every_cell=written),
        n=pair[0],
        n_res=pair[1],
        n_resln=pair[2],
        alpha_mean=pair[3],
    )


def _results(
    n_layers: int, heads: int, t_len: int, compiled: bool, all_rows: bool, device: torch.device
) -> TokenResults:
    """The token passes' results of every layer, uninitialised but probe_err (zero where the attention pass computes
    only some rows)."""
    grams = (2, heads * (heads + 1) // 2) if compiled else (2, heads, heads)
    return TokenResults(
        grams=torch.empty(n_layers, *grams, t_len, device=device),
        probe_f=torch.empty(n_layers, heads, PROBES, t_len, device=device),
        diag=torch.empty(n_layers, 2, t_len, device=device),
        total_r=torch.empty(n_layers, t_len, PROBES, device=device),
        check=torch.empty(n_layers, 2, t_len, device=device),
        probe_err=(torch.empty if all_rows else torch.zeros)(n_layers, t_len, device=device),
    )


def _compiled_on(t: torch.Tensor) -> bool:
    return COMPILED and t.device.type == "cpu"


def _check(
    results: TokenResults,
    tok: RealTokens,
    rows: RowCheck,
    limit: float = TOLERANCE,
    attn_limit: float | None = None,
    row_limit: float = TOLERANCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raise `ReconstructionError` naming the first layer (and where) a piece of the decomposition misses the model's
    own tensors; else the max abs error per input and layer [B, L] and the largest error as a share of its tolerance
    [B, L] (≤ 1: passed). Each error is relative to the size of the row it is in, never to the largest row:

    - every token: the residual sum x_i + attention output and the norm after it (γ, β, s_i) against the model's
      norm input and output, and the probe sums of the computed rows, within `limit` of the row's largest value;
    - the check rows of `rows`: the attention output rebuilt from α's rows, v, W_O and b_O, within `row_limit` of
      the row's norm;
    - bfloat16 / float16 (`attn_limit`): the probe sums of every computed row within `attn_limit` of the largest
      probed attention output of the input (the first check's rounding share alone cannot see a wrong attention
      output under the stream)."""
    err = torch.maximum(results.check[:, 0], results.probe_err)  # [L, T]
    tol = limit * results.check[:, 1]  # [L, T] per row
    bad = ~(err <= tol)  # NaN fails too
    share = err / tol.clamp_min(torch.finfo(torch.float32).tiny)  # [L, T]
    row_abs, row_rel = (torch.where(rows.real, e, 0) for e in rows.errors.unbind(1))  # [L, B, R] real rows only
    row_share = row_rel / row_limit
    own = None
    if attn_limit is not None:  # relative to the attention output's own size (floor: 0.1% of the stream's)
        top = limit * results.check[:, 1].amax(1).clamp_min(1.0)  # [L]
        own = torch.maximum(results.total_r.abs().amax(2).amax(1), 1e-3 * top / limit)
        share = torch.maximum(share, results.probe_err / (attn_limit * own[:, None]))
    for index in range(len(err)):
        if bool(bad[index].any()):
            t = int(bad[index].nonzero()[0, 0])
            offsets = tok.layout.offsets.cpu()
            b = int(torch.searchsorted(offsets, torch.tensor(t), right=True)) - 1
            raise ReconstructionError(
                f"layer {index}: the decomposition differs from the real attention-block output by "
                f"{float(err[index, t]):.3g} at token {t - int(offsets[b])} of input {b + 1} (tolerance "
                f"{float(tol[index, t]):.3g}, {limit:g} of that token's largest value); the adapter for this "
                "architecture does not match the model"
            )
        worst = row_rel[index].nan_to_num(float("inf")).argmax()
        b, k = divmod(int(worst), row_rel.shape[2])
        r = float(row_rel[index, b, k])
        if not r <= row_limit:
            raise ReconstructionError(
                f"layer {index}: the attention output rebuilt from the decomposition (α, v, W_O, b_O) differs from "
                f"the real one by {r:.3g} of its size at token {int(rows.positions[b, k])} of input {b + 1} "
                f"(tolerance {row_limit:.3g}); the adapter for this architecture does not match the model"
            )
        if own is not None and attn_limit is not None:
            r = float(results.probe_err[index].amax() / own[index])
            if not r <= attn_limit:
                raise ReconstructionError(
                    f"layer {index}: the decomposition of the attention output differs from the real one by {r:.3g} "
                    f"of its size (tolerance {attn_limit:.3g}); the adapter for this architecture does not match "
                    "the model"
                )
    error = torch.maximum(tok.scatter(err.T).amax(1), row_abs.amax(2).T)
    return error, torch.maximum(tok.scatter(share.T).amax(1), row_share.amax(2).T)


@dataclass
class RowCheck:
    """The per-row attention check of a run (`attention_row_errors`): its rows and, per layer, their errors."""

    positions: torch.Tensor  # [B, R] int64: `check_positions`
    real: torch.Tensor  # [B, R] bool: a real token (target rows of padding are not checked)
    errors: torch.Tensor  # [L, 2, B, R] max abs error, error relative to the row's size (0 until the layer ran)
    dtype: torch.dtype  # the forward pass's

    @classmethod
    def start(cls, adapter: Adapter, mask: torch.Tensor, targets: torch.Tensor | None) -> RowCheck:
        positions = check_positions(mask, targets)
        real = positions < mask.sum(-1, keepdim=True)
        errors = torch.zeros(adapter.n_layers, 2, *positions.shape, device=mask.device)
        return cls(positions, real, errors, run_dtype(adapter.base))

    def layer(self, lt: LayerTrace, lay: Layer, index: int) -> None:
        """Check layer `index` (its complete trace `lt`: during the forward pass when streamed)."""
        rows = self.positions.clamp_max(lt.x.shape[1] - 1)
        self.errors[index] = attention_row_errors(lt, lay, rows, self.dtype)


@dataclass
class NormRun:
    """The norm engine on one forward pass: all layers at once (`block_norms`) or one layer at a time as the forward
    pass produces them (`stream_layer`, row streaming), then `finish`."""

    adapter: Adapter
    tok: RealTokens
    maps: Maps
    results: TokenResults  # every layer's token-pass results (row l: layer l)
    compiled: _compiled.RunArgs | None  # the compiled kernels' view of tok, results and maps (None: torch passes)
    done: list[int]  # layers whose passes ran, in order
    bias_terms: list[torch.Tensor]  # their [2, d] P(b_O), β
    row_check: RowCheck  # the per-row attention check (`RowCheck.layer` of every layer before `finish`)
    sandwich: bool = False  # a layer had a sandwich norm: the head mean of α is not in `maps.alpha_mean`

    @classmethod
    def start(cls, adapter: Adapter, mask: torch.Tensor, targets: torch.Tensor | None) -> NormRun:
        tok = RealTokens.of(mask, targets)
        compiled, (b, n) = _compiled_on(mask), mask.shape
        heads, t_len = adapter.layers[0].n_heads, len(tok.layout.rows)
        maps = _maps(
            b,
            adapter.n_layers,
            heads,
            n,
            tok.layout.targets.shape[1],
            mask.device,
            compiled and tok.full,
            adapter.family.causal,
        )
        results = _results(adapter.n_layers, heads, t_len, compiled, tok.all_rows, mask.device)
        args = _compiled.RunArgs.of(tok.layout, results, maps, adapter.family.causal) if compiled else None
        return cls(adapter, tok, maps, results, args, [], [], RowCheck.start(adapter, mask, targets))

    def passes(self, layers: list[LayerState]) -> None:
        """Token and attention passes of `layers` (compiled: in one parallel region)."""
        if self.compiled is not None:
            _compiled.passes(layers, self.compiled, TOKEN_BLOCK, self.adapter.family.causal)
        else:
            _torch_passes.token_passes(layers, self.tok, self.results, self.maps, TOKEN_BLOCK)
            _torch_passes.attention_passes(layers, self.tok, self.results, self.maps)
        self._ran(layers)

    def token_passes(self, layers: list[LayerState]) -> None:
        if self.compiled is not None:
            _compiled.token_passes(layers, self.compiled, TOKEN_BLOCK)
        else:
            _torch_passes.token_passes(layers, self.tok, self.results, self.maps, TOKEN_BLOCK)
        self._ran(layers)

    def _ran(self, layers: list[LayerState]) -> None:
        self.done += [st.index for st in layers]
        self.bias_terms += [st.weights.bias_terms for st in layers]

    def rows(self, st: LayerState, tok: RealTokens) -> Maps:
        """The attention pass of one layer (token pass done) over the K' target rows of `tok`: a Maps whose n, n_res,
        n_resln, alpha_mean are [B, 1, K', n] (padding rows 0) and whose per-token fields are the run's."""
        (b, n), k = tok.mask.shape, tok.layout.targets.shape[1]
        pair = [torch.zeros(b, 1, k, n, device=tok.mask.device) for _ in range(4)]
        view = Maps(self.maps.f_norm, self.maps.ratio, self.maps.scale, *pair)
        if self.compiled is not None:
            run = _compiled.RunArgs.of(tok.layout, self.results, view, self.adapter.family.causal)
            _compiled.attention_passes([st], run, self.adapter.family.causal, slot=0)
        else:
            _torch_passes.attention_passes([st], tok, self.results, view, slot=0)
        return view

    def weight_ratios(self, lt: LayerTrace, index: int) -> None:
        """A sandwich layer's passes saw α / s^post: its weight-based ratios come from α itself."""
        if lt.post_scale is not None:
            w = (1 - lt.alpha_diagonal().mean(1)) * self.tok.mask
            self.maps.ratio[0, :, index], self.maps.ratio[2, :, index] = w, w / 2
            self.sandwich = True

    def finish(self) -> BlockNorms:
        """The per-run exactness check over every layer, then the result."""
        if self.done != list(range(self.adapter.n_layers)):
            raise RuntimeError(f"the norm engine ran layers {self.done} of {self.adapter.n_layers}")
        model = self.adapter.base
        error, share = _check(
            self.results,
            self.tok,
            self.row_check,
            tolerance(model),
            ATTN_TOLERANCES.get(run_dtype(model)),
            attn_tolerance(model),
        )
        maps = self.maps
        return BlockNorms(
            f_norm=maps.f_norm,
            n=maps.n,
            n_res=maps.n_res,
            n_resln=maps.n_resln,
            ratio=dict(zip(RATIO_VARIANTS, maps.ratio, strict=True)),
            error=error,
            scale=maps.scale,
            bias_terms=torch.stack(self.bias_terms),
            error_share=share,
        )


@torch.no_grad()
def stream_layer(
    run: NormRun, lt: LayerTrace, index: int, every_row: bool = False
) -> Callable[[torch.Tensor], PairRows] | None:
    """Both passes of one layer, inside the forward pass (row streaming): writes layer `index` of the maps
    (its target rows) and keeps only the pass results the check needs, not α. `every_row`: also returns the rows of
    the layer's N, N-Res and N-ResLN matrices, positions [B, K'] → `PairRows` (what a rollout propagates through):
    from the whole matrices, computed here, or in row mode (`lt.qk`) computed when asked from q and K, with no n × n
    held."""
    tok, maps = run.tok, run.maps
    lay = run.adapter.layers[index]
    run.row_check.layer(lt, lay, index)
    st = LayerState.of(lt, lay, tok, index)
    if not every_row or lt.qk is not None:
        run.passes([st])
        run.weight_ratios(lt, index)
        if not every_row:
            return None
        small = lt.for_rows()

        def rows_of(rows: torch.Tensor) -> PairRows:
            asked = tok.with_targets(rows)
            view = run.rows(LayerState.for_rows(small, lay, asked, index), asked)
            return PairRows(view.n[:, 0], view.n_res[:, 0], view.n_resln[:, 0])

        return rows_of
    run.token_passes([st])
    run.weight_ratios(lt, index)
    b, n = tok.mask.shape
    positions = torch.arange(n, device=tok.mask.device).repeat(b, 1)
    every = RealTokens(tok.mask, tok.layout._replace(targets=positions), tok.full, True)
    view = run.rows(st, every)
    rows = tok.layout.targets
    for out, full in zip(maps[3:], view[3:], strict=True):  # n, n_res, n_resln, alpha_mean
        out[:, index] = full[:, 0].gather(1, rows[:, :, None].expand(-1, -1, n))
    mats = PairRows(view.n[:, 0], view.n_res[:, 0], view.n_resln[:, 0])
    return lambda rows: PairRows(*(m.gather(1, rows[:, :, None].expand(-1, -1, n)) for m in mats))


BLOCK_NORMS = "block_norms"  # memo keys: the engine's result,
NORM_RUN = "norm_run"  # a streamed trace's passes (run during the forward pass),
NORM_STATES = "norm_states"  # row mode: the per-layer state, for `pair_rows`


@torch.no_grad()
def block_norms(trace: Trace) -> BlockNorms:
    """Compute (once per trace, then cached) every norm-based quantity of every layer, and check each layer's
    decomposition against the real attention output, norm input and norm output (`ReconstructionError`). In
    row mode (`rows_of(trace)` [B, K]) the pair maps hold only those rows and the check covers their
    attention rows; the per-token quantities (ratios, scale, f_norm) cover every token. A trace streamed in
    row mode (`pipeline.stream_trace`) had its passes run during the forward pass: only the check is left."""
    memo = memo_of(trace)
    done: BlockNorms | None = memo.get(BLOCK_NORMS)
    if done is None:
        run: NormRun | None = memo.get(NORM_RUN)
        if run is None:
            targets = rows_of(trace)
            run = NormRun.start(trace.adapter, trace.mask, targets)
            layers = [
                LayerState.of(lt, lay, run.tok, i)
                for i, (lt, lay) in enumerate(zip(trace.layers, trace.adapter.layers, strict=True))
            ]
            run.passes(layers)
            for i, lt in enumerate(trace.layers):
                run.weight_ratios(lt, i)
                run.row_check.layer(lt, trace.adapter.layers[i], i)
            if targets is not None:  # kept for `pair_rows` (rollouts propagate through every row of each layer)
                memo.put(NORM_STATES, (layers, run))
        if not run.sandwich:
            memo.put(ALPHA_MEAN, run.maps.alpha_mean)
        done = memo.put(BLOCK_NORMS, run.finish())
    return done


@torch.no_grad()
def pair_rows(trace: Trace, index: int, rows: torch.Tensor) -> Maps:
    """Rows at positions `rows` [B, K'] (padding positions give zero rows) of layer `index`'s pair maps, from the
    token pass kept by `block_norms` in row mode: a Maps whose n, n_res, n_resln, alpha_mean are
    [B, 1, K', n] (other fields: the whole call's)."""
    block_norms(trace)
    states: tuple[list[LayerState], NormRun] | None = memo_of(trace).get(NORM_STATES)
    assert states is not None, "pair_rows needs a (not streamed) trace in row mode"
    layers, run = states
    return run.rows(layers[index], run.tok.with_targets(rows))


@register(
    "norm",
    head_dims=LHTS,
    engine=True,
    row_mode=True,
    default_in={"analyze": 1, "html": 2, "ratio": 0},
    group="mixing-ratio",
    card=Card(
        definition="N_ij = ‖Σ_h α^h_ij f^h(x_j)‖ (Kobayashi et al. 2020); per head ‖α^h_ij f^h(x_j)‖.",
        passes=TRACED + "; the norm engine checks that the vectors rebuild the real attention output.",
        memory="Gram matrices per head, no [H, n, n, d] tensor; output [L, n, n] (per head [L, H, n, n]); requested "
        "rows only with --rows.",
        background=BACKGROUND,
    ),
)
def norm(trace: Trace, *, heads: bool = False) -> torch.Tensor:
    """‖α f(x)‖ (Kobayashi 2020): per head α^h_ij‖f^h(x_j)‖, or ‖Σ_h α^h_ij f^h(x_j)‖ head-summed."""
    bn = block_norms(trace)
    if not heads:
        return bn.n
    rows = rows_of(trace)
    if rows is not None:
        post = [None if lt.post_scale is None else lt.post_scale.gather(1, rows) for lt in trace.layers]  # [B, K]
        alpha = torch.stack(
            [target_alpha(trace, i) / (1 if s is None else s[:, None, :, None]) for i, s in enumerate(post)], dim=1
        )  # the target rows of α_mix
        return alpha * bn.f_norm[:, :, :, None, :]
    alpha = torch.stack([lt.alpha_mix for lt in trace.layers], dim=1).float()
    return alpha * bn.f_norm[:, :, :, None, :] * trace.mask[:, None, None, :, None]


@register(
    "norm_res",
    engine=True,
    row_mode=True,
    default_in={"analyze": 2, "html": 1},
    group="mixing-ratio",
    card=Card(
        definition="N-Res_ij = ‖t_ij‖, attention plus residual (Kobayashi et al. 2021).",
        passes=TRACED + "; the norm engine checks its decomposition.",
        memory="[L, n, n]; requested rows only with --rows.",
        background=BACKGROUND,
    ),
)
def norm_res(trace: Trace) -> torch.Tensor:
    """‖t_ij‖: attention plus residual (Kobayashi 2021, N-Res)."""
    return block_norms(trace).n_res


@register(
    "norm_resln",
    engine=True,
    row_mode=True,
    default_in={"analyze": 3, "html": 0, "plot": 0},
    group="mixing-ratio",
    card=Card(
        definition="N-ResLN_ij = ‖g_i(t_ij)‖, attention, residual and LayerNorm as the linear map g_i at target i "
        "(Kobayashi et al. 2021).",
        passes=TRACED + "; the norm engine checks its decomposition.",
        memory="[L, n, n]; requested rows only with --rows.",
        background=BACKGROUND,
    ),
)
def norm_resln(trace: Trace) -> torch.Tensor:
    """‖g_i(t_ij)‖: attention, residual and LayerNorm (Kobayashi 2021, N-ResLN)."""
    return block_norms(trace).n_resln
