"""Norm-based decomposition of the attention block (Kobayashi et al. 2020, 2021; DESIGN §3.2–3.4).

Per layer, with f^h(x_j) = v^h_j W_O^h and u_ij = Σ_h α^h_ij f^h(x_j):

- N       ‖α^h_ij f^h(x_j)‖ per head, ‖u_ij‖ head-summed
- N-Res   ‖t_ij‖,        t_ij = u_ij + [i=j] x_i
- N-ResLN ‖g_i(t_ij)‖,   g_i(v) = γ ⊙ C(v) / s_i, s_i from the real pre-norm vector

Norms of linear images are taken through per-source Gram matrices (DESIGN §4), never through
[head, target, source, d] tensors. Every call checks that the decomposition sums back to the real
pre-norm vector and norm output of each layer, and raises `ReconstructionError` naming the layer if not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixlens.adapters import Layer, Norm
from mixlens.errors import MixlensError, ReconstructionError
from mixlens.methods._kernels import TOKEN_STATS, attention_pass, gram_pass, parallel, row_splits, token_pass
from mixlens.methods.registry import LHTS, register
from mixlens.trace import LayerTrace, Trace, _repeat_kv

RATIO_VARIANTS = ("W", "N", "Res-W", "Res-N", "ResLN-N")
TOLERANCE = 1e-4  # max abs error, relative to max(1, |real output|)
PROBES = 4  # random directions of the per-run decomposition check
CHUNK_ELEMENTS = 1 << 20  # floats per block of sources in the torch quadratic form (bounds memory)
TOKEN_BLOCK = 128  # tokens per block of head vectors f (the block stays in cache)
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
    v = _repeat_kv(lt.value, lay.n_heads).float()
    w = lay.w_o.float().reshape(lay.n_heads, lay.d_head, -1)
    return torch.einsum("bhjk,hkd->bhjd", v, w)


def attn_sum(lt: LayerTrace, lay: Layer) -> torch.Tensor:
    """Σ_j Σ_h α^h_ij f^h(x_j) (the attention output without b_O): [B, n, d]."""
    z = torch.matmul(lt.alpha.float(), _repeat_kv(lt.value, lay.n_heads).float())  # [B, H, n, d_h]
    return z.transpose(1, 2).flatten(2) @ lay.w_o.float()


@dataclass
class _Weights:
    """Weight-derived tensors of one layer's decomposition (cached on the adapter layer per weight version)."""

    w_c: torch.Tensor  # [H, d_h, d]  W_O^h C (W_O^h for RMSNorm)
    mean_w: torch.Tensor | None  # [H, d_h]  row means of W_O^h (None for RMSNorm)
    gamma2: torch.Tensor  # [d]  γ²
    probes: torch.Tensor  # [P, d]  random directions r_p of the check (fixed seed per layer)
    w_probe: torch.Tensor  # [H, P, d_h]  (W_O^h r_p)ᵀ


def _weights(lay: Layer, index: int) -> _Weights:
    w_o, gamma = lay.w_o, lay.ln_mix.weight
    key = ("norms", index, w_o.data_ptr(), w_o._version, gamma.data_ptr(), gamma._version)
    if key not in lay.cache:
        h, d = lay.n_heads, w_o.shape[-1]
        w = w_o.detach().float().reshape(h, lay.d_head, d)
        mean_w = None if lay.ln_mix.rms else w.mean(-1)
        gen = torch.Generator().manual_seed(index)
        probes = (torch.randn(PROBES, d, generator=gen) / d**0.5).to(w.device)
        lay.cache.clear()  # stale versions
        lay.cache[key] = _Weights(
            w_c=w if mean_w is None else w - mean_w[..., None], mean_w=mean_w,
            gamma2=gamma.detach().float().pow(2), probes=probes,
            w_probe=(probes @ w.reshape(h * lay.d_head, d).T).view(PROBES, h, lay.d_head).transpose(0, 1).contiguous())
    return lay.cache[key]


def _compiled(t: torch.Tensor) -> bool:
    return COMPILED and t.device.type == "cpu"


def _grams(vh: torch.Tensor, wt: _Weights, a_ii: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the value vectors vh [H, T, d_h] of the T real tokens: the Gram matrices of f and of P f = γ ⊙ C f,
    ‖f^h‖ [T, H] and u_ii = Σ_h α^h_ii f^h(x_i) [T, d] (a_ii [H, T]). The grams are packed upper triangles
    [2, H(H+1)/2, T] on the compiled path (see `gram_pass`) and full [2, H, H, T] on the torch path.

    C is folded into the weights (W_O^h C; the mean μ^h = v^h·mean(W_O^h) is added back as a rank-one term),
    so P f·P f' = (γ² ⊙ C f)·C f'. Tokens go in blocks of TOKEN_BLOCK so that C f stays in cache."""
    h, t_len, _ = vh.shape
    wc, mean_w, g2 = wt.w_c, wt.mean_w, wt.gamma2
    d = wc.shape[-1]
    u_ii = vh.new_empty(t_len, d)
    if _compiled(vh):
        grams = vh.new_empty(2, h * (h + 1) // 2, t_len)
        f_norm = vh.new_empty(t_len, h)
        cf = vh.new_empty(h, min(TOKEN_BLOCK, t_len), d)
        arrays = [t.contiguous().numpy() for t in (vh, wc.new_empty(0, vh.shape[2]) if mean_w is None else mean_w,
                                                    g2, a_ii)]
        for s in range(0, t_len, TOKEN_BLOCK):
            e = min(s + TOKEN_BLOCK, t_len)
            torch.matmul(vh[:, s:e], wc, out=cf[:, : e - s])  # [H, c, d]
            gram_pass(cf[:, : e - s].numpy(), *arrays, s, grams.numpy(), f_norm.numpy(), u_ii.numpy())
        return grams, f_norm, u_ii
    raw = vh.new_empty(t_len, h, 2 * h)  # [T, H, 2H] = [C f · C f | C f · γ² C f]
    buf = vh.new_empty(2 * h, min(TOKEN_BLOCK, t_len), d)
    for s in range(0, t_len, TOKEN_BLOCK):
        e = min(s + TOKEN_BLOCK, t_len)
        cf, pf = buf[:h, : e - s], buf[h:, : e - s]
        torch.matmul(vh[:, s:e], wc, out=cf)  # [H, c, d]
        torch.mul(cf, g2, out=pf)
        torch.matmul(cf.transpose(0, 1), buf[:, : e - s].permute(1, 2, 0), out=raw[s:e])
        torch.sum(cf.mul_(a_ii[:, s:e, None]), dim=0, out=u_ii[s:e])  # Σ_h α_ii C f (clobbers cf)
    grams = raw.view(t_len, h, 2, h).permute(2, 1, 3, 0).contiguous()  # [2, H, H, T]
    if mean_w is not None:
        mu = torch.matmul(mean_w[:, None], vh.transpose(1, 2))[:, 0]  # [H, T] mean of f^h over the hidden axis
        grams[0].add_(mu[:, None] * mu[None, :], alpha=d)
        u_ii += (a_ii * mu).sum(0)[:, None]
    f_norm = grams[0].diagonal(dim1=0, dim2=1).clamp_min(0).sqrt()  # [T, H]
    return grams, f_norm, u_ii


@dataclass
class _Pending:
    """One layer after its per-token passes, waiting for its attention pass."""

    index: int
    alpha: torch.Tensor  # [B, H, n, n]
    grams: torch.Tensor  # see `_grams`
    probe_f: torch.Tensor  # [H, P, T]  f^h(x_j)·r_p
    inv_s: torch.Tensor  # [B, n]  1/s_i (0 at padding)
    a_ii: torch.Tensor  # [H, T]
    f_norm: torch.Tensor  # [T, H]
    st: dict[str, torch.Tensor]  # TOKEN_STATS → [T]
    total_r: torch.Tensor  # [T, P]  (attention output − b_O)·r_p
    bias_terms: torch.Tensor  # [2, d]  P(b_O), β
    probed: torch.Tensor | None = None  # [T, P]  Σ_h Σ_j α^h_ij f^h(x_j)·r_p, set by the attention pass


def _token_part(lt: LayerTrace, lay: Layer, tok: _Tokens, index: int) -> _Pending:
    """Everything of one layer that is per token: Gram matrices, u_ii, s_i, the diagonal norms and the ratios."""
    norm, h = lay.ln_mix, lay.n_heads
    alpha = lt.alpha.float()
    vh = tok.gather(_repeat_kv(lt.value, h).float().transpose(1, 2)).transpose(0, 1)  # [H, T, d_h]
    a_ii = tok.gather(alpha.diagonal(dim1=2, dim2=3).transpose(1, 2)).T  # [H, T]
    wt = _weights(lay, index)
    grams, f_norm, u_ii = _grams(vh, wt, a_ii)
    b_o = lay.b_o.float() if lay.b_o is not None else lt.x.new_zeros(lt.x.shape[-1], dtype=torch.float32)
    st, total_r = _token_pass(lt, tok, u_ii, b_o, norm, wt.probes)  # {stat: [T]}, [T, P]
    return _Pending(index=index, alpha=alpha, grams=grams, probe_f=torch.matmul(wt.w_probe, vh.transpose(1, 2)),
                    inv_s=tok.scatter(1 / st["s"]).contiguous(), a_ii=a_ii, f_norm=f_norm, st=st, total_r=total_r,
                    bias_terms=torch.stack([norm.project(b_o), norm.shift().float()]))


def _finish(pl: _Pending, tok: _Tokens, outs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diagonals of N-Res and N-ResLN, the reconstruction check (raises naming the layer) and the ratios."""
    st, s, index = pl.st, pl.st["s"], pl.index
    outs["n_res"][:, index].diagonal(dim1=1, dim2=2).copy_(tok.scatter(st["t_norm"]))
    outs["n_resln"][:, index].diagonal(dim1=1, dim2=2).copy_(tok.scatter(st["pt_norm"] / s))
    errors = torch.stack([(pl.probed - pl.total_r).abs().amax(-1), st["err_in"], st["err_out"]]).amax(0)  # [T]
    error = tok.scatter(errors).amax(-1)  # [B]
    scale = st["scale"].amax().clamp_min(1.0)
    if error.max() > TOLERANCE * scale:
        raise ReconstructionError(
            f"layer {index}: the decomposition differs from the real attention-block output by "
            f"{error.max().item():.3g} (tolerance {TOLERANCE * scale.item():.3g}); the adapter for this "
            "architecture does not match the model"
        )
    w_mix = 1 - pl.a_ii.mean(0)
    ratio = {"W": w_mix, "N": st["N"], "Res-W": w_mix / 2, "Res-N": st["Res-N"], "ResLN-N": st["ResLN-N"]}
    return {"f_norm": pl.f_norm, "scale": s, "bias_terms": pl.bias_terms, "error": error,
            **{f"ratio:{k}": v for k, v in ratio.items()}}


def _token_pass(lt: LayerTrace, tok: _Tokens, u_ii: torch.Tensor, b_o: torch.Tensor, norm: Norm,
                probes: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-token statistics of one layer (see `token_pass`): ({name: [T]}, total·r_p [T, P])."""
    gamma, beta = norm.weight.float(), norm.shift().float()
    if _compiled(u_ii):
        t_len = u_ii.shape[0]
        stats, total_r = torch.empty(t_len, len(TOKEN_STATS)), torch.empty(t_len, PROBES)
        flat = [t.float().flatten(0, 1).contiguous() for t in (lt.x, lt.attn_out, lt.mix_in, lt.mix_out)]
        arrays = [a.contiguous().numpy() for a in (tok.rows, *flat, u_ii, b_o, gamma, beta, probes)]
        token_pass(*arrays, norm.eps, norm.rms, stats.numpy(), total_r.numpy())
        return dict(zip(TOKEN_STATS, stats.unbind(1), strict=True)), total_r
    x, attn_out, mix_in, mix_out = (tok.gather(t.float()) for t in (lt.x, lt.attn_out, lt.mix_in, lt.mix_out))
    total = attn_out - b_o
    t_ii, off = u_ii + x, total - u_ii
    s = norm.scale(mix_in)
    y = attn_out + x
    rebuilt = norm.project(y) / s[:, None] + beta
    tn, ptn, on, un, pon = (v.norm(dim=-1) for v in (t_ii, norm.project(t_ii), off, u_ii, norm.project(off)))

    def r(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a / (a + b).clamp_min(1e-30)

    vals = [s, tn, ptn, r(on, un), r(on, tn), r(pon, ptn), (y - mix_in).abs().amax(-1),
            (rebuilt - mix_out).abs().amax(-1), torch.maximum(mix_in.abs().amax(-1), rebuilt.abs().amax(-1))]
    return dict(zip(TOKEN_STATS, vals, strict=True)), total @ probes.T


def _attention_passes(pending: list[_Pending], tok: _Tokens, causal: bool, outs: dict[str, torch.Tensor]) -> None:
    """The per-(target, source) part of every layer: fills n, n_res, n_resln and the head-mean α in `outs` and
    sets each layer's probe sums. Compiled: all layers' row ranges go to the threads of `parallel` at once."""
    b, h, n, _ = pending[0].alpha.shape
    if _compiled(pending[0].alpha):
        lengths = tok.lengths.numpy()
        splits = row_splits(lengths, n, causal, torch.get_num_threads())
        calls = []
        for pl in pending:
            probed = torch.zeros(b, n, pl.probe_f.shape[1])
            pl.probed = probed
            arrays = [a.contiguous().numpy() for a in (pl.alpha, pl.grams, pl.probe_f, tok.offsets, tok.lengths,
                                                        pl.inv_s)]
            calls += [(attention_pass, *arrays, causal, pl.index, r0, r1,
                       *(outs[k].numpy() for k in ("n", "n_res", "n_resln", "alpha_mean")), probed.numpy())
                      for r0, r1 in splits]
        parallel(calls)
        for pl in pending:
            pl.probed = tok.gather(pl.probed)
        return
    pair = (tok.mask[:, :, None] & tok.mask[:, None, :]).float()
    for pl in pending:
        full = pl.grams.new_zeros(2, b, h, h, n)
        for k in range(b):  # back to the padded layout of the batch
            o, m = int(tok.offsets[k]), int(tok.lengths[k])
            full[:, k, :, :, :m] = pl.grams[..., o : o + m]
        n_n, n_resln = quad_norms(pl.alpha, full) * pair
        outs["n"][:, pl.index] = n_n
        outs["n_res"][:, pl.index] = n_n
        outs["n_resln"][:, pl.index] = n_resln * pl.inv_s[:, :, None]
        outs["alpha_mean"][:, pl.index] = pl.alpha.mean(1) * pair
        fp = tok.scatter(pl.probe_f.permute(2, 0, 1)).permute(0, 2, 1, 3)  # [B, H, n, P]
        pl.probed = tok.gather(torch.matmul(pl.alpha, fp).sum(1))


@torch.no_grad()
def block_norms(trace: Trace) -> BlockNorms:
    """Compute (once per trace, then cached) every norm-based quantity of every layer, and check each layer's
    decomposition against the real attention output, norm input and norm output (`ReconstructionError`)."""
    if "block_norms" not in trace.cache:
        tok = _Tokens.of(trace.mask)
        b, n = trace.mask.shape
        shape = (b, trace.adapter.n_layers, n, n)
        causal = trace.adapter.family.causal
        # the compiled pass writes every real (target, source) cell; only padding and a causal triangle stay 0
        alloc = torch.empty if tok.full and not causal and _compiled(trace.mask) else torch.zeros
        outs = {k: alloc(shape, device=trace.mask.device) for k in ("n", "n_res", "n_resln", "alpha_mean")}
        pending = [_token_part(lt, lay, tok, i) for i, (lt, lay) in
                   enumerate(zip(trace.layers, trace.adapter.layers, strict=True))]
        _attention_passes(pending, tok, causal, outs)
        per = [_finish(pl, tok, outs) for pl in pending]

        def stacked(key: str) -> torch.Tensor:
            return torch.stack([tok.scatter(p[key]) for p in per], dim=1)

        trace.cache["alpha_mean"] = outs["alpha_mean"]
        trace.cache["block_norms"] = BlockNorms(
            f_norm=stacked("f_norm").permute(0, 1, 3, 2), n=outs["n"], n_res=outs["n_res"], n_resln=outs["n_resln"],
            ratio={v: stacked(f"ratio:{v}") for v in RATIO_VARIANTS}, error=torch.stack([p["error"] for p in per], 1),
            scale=stacked("scale"), bias_terms=torch.stack([p["bias_terms"] for p in per]),
        )
    return trace.cache["block_norms"]


@register("norm", head_dims=LHTS)
def norm(trace: Trace, *, heads: bool = False) -> torch.Tensor:
    """‖α f(x)‖ (Kobayashi 2020): per head α^h_ij‖f^h(x_j)‖, or ‖Σ_h α^h_ij f^h(x_j)‖ head-summed."""
    bn = block_norms(trace)
    if not heads:
        return bn.n
    alpha = torch.stack([lt.alpha for lt in trace.layers], dim=1).float()
    return alpha * bn.f_norm[:, :, :, None, :] * trace.mask[:, None, None, :, None]


@register("norm_res")
def norm_res(trace: Trace) -> torch.Tensor:
    """‖t_ij‖: attention plus residual (Kobayashi 2021, N-Res)."""
    return block_norms(trace).n_res


@register("norm_resln")
def norm_resln(trace: Trace) -> torch.Tensor:
    """‖g_i(t_ij)‖: attention, residual and LayerNorm (Kobayashi 2021, N-ResLN)."""
    return block_norms(trace).n_resln
