"""Norm-based decomposition of the attention block (Kobayashi et al. 2020, 2021; docs/DESIGN.md §3.2–3.4).

Per layer, with f^h(x_j) = v^h_j W_O^h and u_ij = Σ_h α^h_ij f^h(x_j):

- N       ‖α^h_ij f^h(x_j)‖ per head, ‖u_ij‖ head-summed
- N-Res   ‖t_ij‖,        t_ij = u_ij + [i=j] x_i
- N-ResLN ‖g_i(t_ij)‖,   g_i(v) = γ ⊙ C(v) / s_i, s_i from the real pre-norm vector

Norms of linear images are taken through per-source Gram matrices (docs/DESIGN.md §4), never through
[head, target, source, d] tensors. Every call checks that the decomposition sums back to the real
pre-norm vector and norm output of each layer, and raises `ReconstructionError` naming the layer if not.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from mixlens.adapters import Layer
from mixlens.errors import MixlensError, ReconstructionError
from mixlens.methods._kernels import attention_pass, parallel, row_splits, token_pass, token_splits
from mixlens.methods.registry import LHTS, register
from mixlens.trace import LayerTrace, Trace, repeat_kv

RATIO_VARIANTS = ("W", "N", "Res-W", "Res-N", "ResLN-N")
TOLERANCE = 1e-4  # max abs error, relative to max(1, |real output|)
PROBES = 4  # random directions of the per-run decomposition check
CHUNK_ELEMENTS = 1 << 20  # floats per block of sources in the torch quadratic form (bounds memory)
TOKEN_BLOCK = 256  # tokens per block of head vectors C f
CF_BUDGET = 1 << 25  # floats of head vectors C f held at once (128 MiB), over layers and blocks
COMPILED = True  # CPU: the numba passes of `_kernels`; False (and other devices): the plain torch passes


@dataclass
class BlockNorms:
    """All norm-based quantities of a trace. B=batch, L=layer, H=head, n=tokens, d=hidden; padding is 0."""

    f_norm: torch.Tensor  # [B, L, H, n(source)]  ‖f^h(x_j)‖
    n: torch.Tensor  # [B, L, n, n]  ‖u_ij‖
    n_res: torch.Tensor  # [B, L, n, n]  ‖t_ij‖
    n_resln: torch.Tensor  # [B, L, n, n]  ‖g_i(t_ij)‖
    ratio: dict[str, torch.Tensor]  # variant → [B, L, n(target)] context-mixing ratio r_i
    error: torch.Tensor  # [B, L] max abs reconstruction error (pre-norm sum and norm output)
    scale: torch.Tensor  # [B, L, n]  s_i of the norm after attention (0 at padding)
    bias_terms: torch.Tensor  # [L, 2, d]  P(b_O) and β per layer

    @property
    def bias(self) -> torch.Tensor:
        """g_i(b_O) + β = P(b_O) / s_i + β, the part of the norm output no token owns: [B, L, n, d]."""
        real = self.scale > 0
        inv = torch.where(real, 1 / self.scale.clamp_min(torch.finfo(self.scale.dtype).tiny), 0)
        p_b, beta = self.bias_terms[:, 0], self.bias_terms[:, 1]
        return (p_b[:, None] * inv[..., None] + beta[:, None]) * real[..., None]


@dataclass
class _Tokens:
    """Where the T real tokens of a right-padded batch are."""

    mask: torch.Tensor  # [B, n] bool
    lengths: torch.Tensor  # [B] int64
    offsets: torch.Tensor  # [B] int64: index of (b, 0) among the T real tokens
    rows: torch.Tensor  # [T] int64: row of each real token in the flattened [B·n, ...] layout
    full: bool  # no padding at all

    @classmethod
    def of(cls, mask: torch.Tensor) -> _Tokens:
        lengths = mask.sum(-1)
        prefix = torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]
        if not torch.equal(prefix, mask):
            raise MixlensError("the norm decomposition needs right-padded batches (real tokens first)")
        offsets = torch.cumsum(lengths, 0) - lengths
        rows = mask.flatten().nonzero().squeeze(1)
        return cls(mask, lengths, offsets, rows, bool(lengths.min() == mask.shape[1]))

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """[B, n, ...] → [T, ...]."""
        flat = t.flatten(0, 1)
        return flat if self.full else flat.index_select(0, self.rows)

    def scatter(self, t: torch.Tensor) -> torch.Tensor:
        """[T, ...] → [B, n, ...] with zeros at padding."""
        if self.full:
            return t.view(*self.mask.shape, *t.shape[1:])
        out = t.new_zeros(self.mask.numel(), *t.shape[1:])
        return out.index_copy_(0, self.rows, t).view(*self.mask.shape, *t.shape[1:])


def quad_norms(alpha: torch.Tensor, grams: torch.Tensor) -> torch.Tensor:
    """‖Σ_h α^h_ij F_k^h(x_j)‖ for K linear images at once, from α [B, H, n, n] and the per-source Gram
    matrices G_k[h, h', j] as grams [K, B, H, H, n] → [K, B, n(target), n(source)]. Plain torch (any device):
    α is transposed source-major in blocks so that each source's Gram matrix is one small matmul."""
    k, b, h, _, n_s = grams.shape
    n_t = alpha.shape[2]
    g = grams.permute(1, 4, 0, 2, 3).reshape(b, n_s, k * h, h)  # [B, j, K·H, H]
    out = alpha.new_empty(b, n_s, k, n_t)
    step = max(1, CHUNK_ELEMENTS // max(1, b * (k + 1) * h * n_t))
    for s in range(0, n_s, step):
        a = alpha[..., s : s + step].transpose(-1, -2).contiguous().transpose(1, 2)  # [B, j, H, i]
        ag = torch.matmul(g[:, s : s + step], a).unflatten(2, (k, h))  # [B, j, K, H, i]
        torch.sum(ag.mul_(a.unsqueeze(2)), dim=3, out=out[:, s : s + step])
    return out.clamp_min_(0).sqrt_().permute(2, 0, 3, 1)


def quad_norm(alpha: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """‖Σ_h α^h_ij F^h_j‖ from α [B, H, n, n] and one per-source Gram G_j [B, n, H, H] → [B, n, n]."""
    return quad_norms(alpha, gram.permute(0, 2, 3, 1).unsqueeze(0))[0]


def head_vectors(lt: LayerTrace, lay: Layer) -> torch.Tensor:
    """f^h(x_j) = v^h_j W_O^h for every head and source: [B, H, n, d]."""
    v = repeat_kv(lt.value, lay.n_heads).float()
    w = lay.w_o.float().reshape(lay.n_heads, lay.d_head, -1)
    return torch.einsum("bhjk,hkd->bhjd", v, w)


def attn_sum(lt: LayerTrace, lay: Layer) -> torch.Tensor:
    """Σ_j Σ_h α^h_ij f^h(x_j) (the attention output without b_O): [B, n, d]."""
    z = torch.matmul(lt.alpha.float(), repeat_kv(lt.value, lay.n_heads).float())  # [B, H, n, d_h]
    return z.transpose(1, 2).flatten(2) @ lay.w_o.float()


@dataclass
class _Weights:
    """Weight-derived tensors of one layer's decomposition (cached on the adapter layer per weight version)."""

    w_c: torch.Tensor  # [H, d_h, d]  W_O^h C (W_O^h for RMSNorm)
    mean_w: torch.Tensor | None  # [H, d_h]  row means of W_O^h (None for RMSNorm)
    gamma2: torch.Tensor  # [d]  γ²
    probes: torch.Tensor  # [P, d]  random directions r_p of the check (fixed seed per layer)
    w_probe: torch.Tensor  # [H, P, d_h]  (W_O^h r_p)ᵀ
    b_o: torch.Tensor  # [d]  (zeros without an output bias)
    gamma: torch.Tensor  # [d]
    beta: torch.Tensor  # [d]  (zeros for RMSNorm)
    bias_terms: torch.Tensor  # [2, d]  P(b_O), β


def _weights(lay: Layer, index: int) -> _Weights:
    norm, w_o = lay.ln_mix, lay.w_o
    key = ("norms", index, *(None if t is None else (t.data_ptr(), t._version)
                             for t in (w_o, norm.weight, norm.bias, lay.b_o)))
    if key not in lay.cache:
        h, d = lay.n_heads, w_o.shape[-1]
        w = w_o.detach().float().reshape(h, lay.d_head, d)
        mean_w = None if norm.rms else w.mean(-1)
        gen = torch.Generator().manual_seed(index)
        probes = (torch.randn(PROBES, d, generator=gen) / d**0.5).to(w.device)
        b_o = lay.b_o.detach().float() if lay.b_o is not None else w.new_zeros(d)
        beta = norm.shift().detach().float()
        lay.cache.clear()  # stale versions
        lay.cache[key] = _Weights(
            w_c=w if mean_w is None else w - mean_w[..., None], mean_w=mean_w,
            gamma2=norm.weight.detach().float().pow(2), probes=probes,
            w_probe=(probes @ w.reshape(h * lay.d_head, d).T).view(PROBES, h, lay.d_head).transpose(0, 1).contiguous(),
            b_o=b_o, gamma=norm.weight.detach().float(), beta=beta,
            bias_terms=torch.stack([norm.project(b_o).detach(), beta]))
    return lay.cache[key]


def _compiled(t: torch.Tensor) -> bool:
    return COMPILED and t.device.type == "cpu"


@dataclass
class _Pending:
    """One layer on its way through the token pass and the attention pass. T = real tokens, P = probes."""

    index: int
    trace: LayerTrace
    layer: Layer
    wt: _Weights
    alpha: torch.Tensor  # [B, H, n, n]
    vh: torch.Tensor  # [H, T, d_h]  value vectors of the real tokens (contiguous)
    a_ii: torch.Tensor  # [H, T]  α^h_ii
    # set by the token pass:
    grams: torch.Tensor = field(init=False)  # packed upper triangles [2, H(H+1)/2, T] (compiled, see `token_pass`)
    # or full [2, H, H, T] (torch)
    probe_f: torch.Tensor = field(init=False)  # [H, P, T]  f^h(x_j)·r_p
    diag: torch.Tensor = field(init=False)  # [2, T]  ‖t_ii‖, ‖P t_ii‖/s_i
    total_r: torch.Tensor = field(init=False)  # [T, P]  (attention output − b_O)·r_p
    check: torch.Tensor = field(init=False)  # [2, T]  reconstruction error of the norm input and output, output scale
    probe_err: torch.Tensor = field(init=False)  # [T]  error of the probe sums, set by the attention pass

    @classmethod
    def of(cls, lt: LayerTrace, lay: Layer, tok: _Tokens, index: int) -> _Pending:
        alpha = lt.alpha_mix.float()  # α / s^post_i with a sandwich norm
        vh = tok.gather(repeat_kv(lt.value, lay.n_heads).float().transpose(1, 2)).transpose(0, 1).contiguous()
        a_ii = tok.gather(alpha.diagonal(dim1=2, dim2=3).transpose(1, 2)).T.contiguous()
        return cls(index, lt, lay, _weights(lay, index), alpha, vh, a_ii)


_SCRATCH = threading.local()


def _scratch(size: int, device: torch.device) -> torch.Tensor:
    """A flat float buffer of at least `size` elements, kept per thread and device: fresh memory costs page faults
    on every call, about as much as the matmul that fills it."""
    buf = getattr(_SCRATCH, str(device), None)
    if buf is None or buf.numel() < size:
        buf = torch.empty(size, device=device)
        setattr(_SCRATCH, str(device), buf)
    return buf


def _token_passes(pending: list[_Pending], tok: _Tokens, outs: dict[str, torch.Tensor]) -> None:
    """Everything per token of every layer: Gram matrices, s_i, the diagonal norms and the ratios (written into
    outs f_norm, ratio and scale, the rest into each `_Pending`).

    Compiled: C f = v W_O^h C by torch for blocks of TOKEN_BLOCK tokens of many layers first (up to CF_BUDGET
    floats), then `token_pass` over all those blocks on torch's threads, so that torch's OpenMP workers, which spin
    for some milliseconds after each torch call, are in the way only once per group."""
    if not _compiled(pending[0].vh):
        for pl in pending:
            _token_torch(pl, tok, outs)
        return
    args, jobs = {}, []
    for pl in pending:
        h, t_len, d_h = pl.vh.shape
        pl.grams, pl.probe_f = pl.vh.new_empty(2, h * (h + 1) // 2, t_len), pl.vh.new_empty(h, PROBES, t_len)
        pl.diag, pl.total_r, pl.check = (pl.vh.new_empty(*shape) for shape in ((2, t_len), (t_len, PROBES), (2, t_len)))
        wt, norm = pl.wt, pl.layer.ln_mix
        flat = [t.float().flatten(0, 1) for t in (pl.trace.x, pl.trace.attn_out, pl.trace.mix_in, pl.trace.mix_out)]
        mean_w = pl.vh.new_empty(0, d_h) if wt.mean_w is None else wt.mean_w
        ins = [t.contiguous().numpy() for t in (pl.vh, pl.a_ii, tok.rows, *flat, mean_w, wt.gamma2, wt.w_probe,
                                                wt.b_o, wt.gamma, wt.beta, wt.probes)]
        res = [t.numpy() for t in (pl.grams, pl.probe_f, pl.diag, pl.total_r, pl.check, outs["f_norm"],
                                   outs["ratio"], outs["scale"])]
        args[pl.index] = (*ins, norm.eps, norm.rms, pl.index, *res)
        jobs += [(pl, s, min(s + TOKEN_BLOCK, t_len)) for s in range(0, t_len, TOKEN_BLOCK)]
    for group in _groups(jobs):
        sizes = [pl.vh.shape[0] * (e - s) * pl.wt.w_c.shape[-1] for pl, s, e in group]
        space, at, cfs = _scratch(sum(sizes), tok.rows.device), 0, []
        for (pl, s, e), size in zip(group, sizes, strict=True):
            out = space[at : at + size].view(pl.vh.shape[0], e - s, -1)  # [H, c, d], a view of one reused buffer
            cfs.append(torch.matmul(pl.vh[:, s:e], pl.wt.w_c, out=out))
            at += size
        parallel([(token_pass, cf.numpy(), s, a, b, *args[pl.index])
                  for (pl, s, e), cf in zip(group, cfs, strict=True) for a, b in token_splits(e - s)])


def _groups(jobs: list[tuple[_Pending, int, int]]) -> list[list[tuple[_Pending, int, int]]]:
    """(layer, first token, end token) blocks in consecutive groups of at most CF_BUDGET floats of C f each."""
    groups: list[list[tuple[_Pending, int, int]]] = [[]]
    size = 0
    for pl, s, e in jobs:
        floats = pl.vh.shape[0] * (e - s) * pl.wt.w_c.shape[-1]
        if groups[-1] and size + floats > CF_BUDGET:
            groups.append([])
            size = 0
        groups[-1].append((pl, s, e))
        size += floats
    return groups


def _token_torch(pl: _Pending, tok: _Tokens, outs: dict[str, torch.Tensor]) -> None:
    """Plain-torch token pass of one layer (any device), with full Gram matrices [2, H, H, T]. C is folded into the
    weights (W_O^h C; the mean μ^h = v^h·mean(W_O^h) comes back as a rank-one term), so P f·P f' =
    (γ² ⊙ C f)·C f'."""
    lt, wt, vh, a_ii, index = pl.trace, pl.wt, pl.vh, pl.a_ii, pl.index
    norm, (h, t_len, _), d = pl.layer.ln_mix, vh.shape, wt.w_c.shape[-1]
    raw = vh.new_empty(t_len, h, 2 * h)  # [T, H, 2H] = [C f · C f | C f · γ² C f]
    u_ii = vh.new_empty(t_len, d)
    buf = vh.new_empty(2 * h, min(TOKEN_BLOCK, t_len), d)
    for s in range(0, t_len, TOKEN_BLOCK):
        e = min(s + TOKEN_BLOCK, t_len)
        cf, pf = buf[:h, : e - s], buf[h:, : e - s]
        torch.matmul(vh[:, s:e], wt.w_c, out=cf)  # [H, c, d]
        torch.mul(cf, wt.gamma2, out=pf)
        torch.matmul(cf.transpose(0, 1), buf[:, : e - s].permute(1, 2, 0), out=raw[s:e])
        torch.sum(cf.mul_(a_ii[:, s:e, None]), dim=0, out=u_ii[s:e])  # Σ_h α_ii C f (clobbers cf)
    grams = raw.view(t_len, h, 2, h).permute(2, 1, 3, 0).contiguous()  # [2, H, H, T]
    if wt.mean_w is not None:
        mu = torch.matmul(wt.mean_w[:, None], vh.transpose(1, 2))[:, 0]  # [H, T] mean of f^h over the hidden axis
        grams[0].add_(mu[:, None] * mu[None, :], alpha=d)
        u_ii += (a_ii * mu).sum(0)[:, None]
    f_norm = grams[0].diagonal(dim1=0, dim2=1).clamp_min(0).sqrt()  # [T, H]

    x, attn_out, mix_in, mix_out = (tok.gather(t.float()) for t in (lt.x, lt.attn_out, lt.mix_in, lt.mix_out))
    total = attn_out - wt.b_o
    t_ii, off = u_ii + x, total - u_ii
    s_i = norm.scale(mix_in)  # [T]
    y = attn_out + x
    rebuilt = norm.project(y) / s_i[:, None] + wt.beta
    tn, ptn, on, un, pon = (v.norm(dim=-1) for v in (t_ii, norm.project(t_ii), off, u_ii, norm.project(off)))

    def r(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a / (a + b).clamp_min(1e-30)

    w_mix = 1 - a_ii.mean(0)
    ratios = torch.stack([w_mix, r(on, un), w_mix / 2, r(on, tn), r(pon, ptn)], -1)  # [T, 5] in RATIO_VARIANTS order
    outs["f_norm"][:, index] = tok.scatter(f_norm).transpose(1, 2)
    outs["ratio"][:, :, index] = tok.scatter(ratios).permute(2, 0, 1)
    outs["scale"][:, index] = tok.scatter(s_i)
    err = torch.maximum((y - mix_in).abs().amax(-1), (rebuilt - mix_out).abs().amax(-1))
    top = torch.maximum(mix_in.abs().amax(-1), rebuilt.abs().amax(-1))
    pl.grams, pl.probe_f = grams, torch.matmul(wt.w_probe, vh.transpose(1, 2))
    pl.diag, pl.total_r, pl.check = torch.stack([tn, ptn / s_i]), total @ wt.probes.T, torch.stack([err, top])


def _attention_passes(pending: list[_Pending], tok: _Tokens, causal: bool, outs: dict[str, torch.Tensor]) -> None:
    """The per-(target, source) part of every layer: fills the maps n, n_res, n_resln and alpha_mean in `outs` and
    sets each layer's probe error. Compiled: all layers' row ranges go to the threads of `parallel` at once."""
    b, h, n, _ = pending[0].alpha.shape
    maps = [outs[k] for k in ("n", "n_res", "n_resln", "alpha_mean")]
    if _compiled(pending[0].alpha):
        splits = row_splits(tok.lengths.numpy(), n, causal)
        where = [t.numpy() for t in (tok.offsets, tok.lengths, outs["scale"])]
        out = [m.numpy() for m in maps]
        calls = []
        for pl in pending:
            pl.probe_err = pl.diag.new_empty(pl.diag.shape[1])
            arrays = [a.contiguous().numpy() for a in (pl.alpha, pl.grams, pl.probe_f)]
            calls += [(attention_pass, *arrays, *where, pl.diag.numpy(), pl.total_r.numpy(), causal, pl.index, r0, r1,
                       *out, pl.probe_err.numpy()) for r0, r1 in splits]
        parallel(calls)
        return
    pair = (tok.mask[:, :, None] & tok.mask[:, None, :]).float()
    for pl in pending:
        full = pl.grams.new_zeros(2, b, h, h, n)
        for k in range(b):  # back to the padded layout of the batch
            o, m = int(tok.offsets[k]), int(tok.lengths[k])
            full[:, k, :, :, :m] = pl.grams[..., o : o + m]
        n_n, n_resln = quad_norms(pl.alpha, full) * pair
        inv_s = torch.where(tok.mask, 1 / outs["scale"][:, pl.index], 0)  # [B, n]
        for dest, v in zip(maps, (n_n, n_n, n_resln * inv_s[:, :, None], pl.alpha.mean(1) * pair), strict=True):
            dest[:, pl.index] = v
        for dest, v in zip(maps[1:3], pl.diag, strict=True):
            dest[:, pl.index].diagonal(dim1=1, dim2=2).copy_(tok.scatter(v))
        fp = tok.scatter(pl.probe_f.permute(2, 0, 1)).permute(0, 2, 1, 3)  # [B, H, n, P]
        pl.probe_err = (tok.gather(torch.matmul(pl.alpha, fp).sum(1)) - pl.total_r).abs().amax(-1)


def _check(pending: list[_Pending], tok: _Tokens) -> torch.Tensor:
    """Raise `ReconstructionError` naming the first layer whose decomposition misses the real outputs; else the max
    abs error per input and layer [B, L]."""
    err = torch.stack([torch.maximum(pl.check[0], pl.probe_err) for pl in pending])  # [L, T]
    tol = TOLERANCE * torch.stack([pl.check[1] for pl in pending]).amax(1).clamp_min(1.0)  # [L]
    worst = err.amax(1)
    for pl, e, t in zip(pending, worst.tolist(), tol.tolist(), strict=True):
        if e > t:
            raise ReconstructionError(
                f"layer {pl.index}: the decomposition differs from the real attention-block output by {e:.3g} "
                f"(tolerance {t:.3g}); the adapter for this architecture does not match the model"
            )
    return tok.scatter(err.T).amax(1)


@torch.no_grad()
def block_norms(trace: Trace) -> BlockNorms:
    """Compute (once per trace, then cached) every norm-based quantity of every layer, and check each layer's
    decomposition against the real attention output, norm input and norm output (`ReconstructionError`)."""
    if "block_norms" not in trace.cache:
        tok = _Tokens.of(trace.mask)
        b, n = trace.mask.shape
        ad = trace.adapter
        causal, n_layers, heads = ad.family.causal, ad.n_layers, ad.layers[0].n_heads
        # the compiled passes write every real cell; only padding and a causal triangle stay 0
        full = tok.full and _compiled(trace.mask)
        alloc = torch.empty if full and not causal else torch.zeros
        outs = {k: alloc(b, n_layers, n, n, device=trace.mask.device) for k in ("n", "n_res", "n_resln", "alpha_mean")}
        alloc = torch.empty if full else torch.zeros
        outs |= {"f_norm": alloc(b, n_layers, heads, n, device=trace.mask.device),
                 "ratio": alloc(len(RATIO_VARIANTS), b, n_layers, n, device=trace.mask.device),
                 "scale": alloc(b, n_layers, n, device=trace.mask.device)}
        pending = [_Pending.of(lt, lay, tok, i) for i, (lt, lay) in
                   enumerate(zip(trace.layers, ad.layers, strict=True))]
        _token_passes(pending, tok, outs)
        _attention_passes(pending, tok, causal, outs)
        error = _check(pending, tok)
        sandwich = [i for i, lt in enumerate(trace.layers) if lt.post_scale is not None]
        if sandwich:  # the passes saw α / s^post: the weight-based ratios come from α itself
            for i in sandwich:
                w = (1 - trace.layers[i].alpha.float().diagonal(dim1=2, dim2=3).mean(1)) * trace.mask
                outs["ratio"][0, :, i], outs["ratio"][2, :, i] = w, w / 2
        else:
            trace.cache["alpha_mean"] = outs["alpha_mean"]
        trace.cache["block_norms"] = BlockNorms(
            f_norm=outs["f_norm"], n=outs["n"], n_res=outs["n_res"], n_resln=outs["n_resln"],
            ratio=dict(zip(RATIO_VARIANTS, outs["ratio"], strict=True)), error=error, scale=outs["scale"],
            bias_terms=torch.stack([pl.wt.bias_terms for pl in pending]),
        )
    return trace.cache["block_norms"]


@register("norm", head_dims=LHTS)
def norm(trace: Trace, *, heads: bool = False) -> torch.Tensor:
    """‖α f(x)‖ (Kobayashi 2020): per head α^h_ij‖f^h(x_j)‖, or ‖Σ_h α^h_ij f^h(x_j)‖ head-summed."""
    bn = block_norms(trace)
    if not heads:
        return bn.n
    alpha = torch.stack([lt.alpha_mix for lt in trace.layers], dim=1).float()
    return alpha * bn.f_norm[:, :, :, None, :] * trace.mask[:, None, None, :, None]


@register("norm_res")
def norm_res(trace: Trace) -> torch.Tensor:
    """‖t_ij‖: attention plus residual (Kobayashi 2021, N-Res)."""
    return block_norms(trace).n_res


@register("norm_resln")
def norm_resln(trace: Trace) -> torch.Tensor:
    """‖g_i(t_ij)‖: attention, residual and LayerNorm (Kobayashi 2021, N-ResLN)."""
    return block_norms(trace).n_resln
