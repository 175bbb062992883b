"""GlobEnc (Modarressi et al. 2022; docs/DESIGN.md §3.5): whole-encoder-layer norms and their rollout.

Post-LN layer: with t_ij = Σ_h α^h_ij f^h(x_j) + [i=j] x_i, LN1 as g1_i(v) = P1(v)/s1_i and LN2 as
g2_i(v) = P2(v)/s2_i (s2 from the real LN2 input, so the FFN enters only through that scale):

    out_i = Σ_j g2_i(g1_i(t_ij)) + g2_i(g1_i(b_O) + β1) + g2_i(FFN_i) + β2      (exact)

N-Enc_ij = ‖g2_i(g1_i(t_ij))‖, taken through per-source Gram matrices of P2∘P1 f^h_j (docs/DESIGN.md §4).
Pre-LN layers (GPT-2, Llama) have no norm on the residual path, so N-Enc_ij = ‖t_ij‖ there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mixlens.adapters import Family, Layer
from mixlens.errors import ReconstructionError
from mixlens.methods.alti import projected_head_vectors
from mixlens.methods.attention import alpha_rows, rows_of
from mixlens.methods.engine import attn_sum, block_norms, head_vectors, pair_rows, quad_norm, tolerance
from mixlens.methods.memo import RowsFn, StreamLayer, gathered, memo_of
from mixlens.methods.registry import ROLLOUT_MEMORY, Card, Option, Stream, register, vector_block
from mixlens.methods.rollout import kept_matrices, pair_mask, rollout, rollout_rows, row_pair_mask
from mixlens.trace import LayerTrace, Trace

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("global.md", "whole-layer and global attribution")


def _maps(lt: LayerTrace, lay: Layer):
    """(P = P2∘P1 as a function on [..., d], 1/(s1_i s2_i) [B, n])."""
    ln1, ln2, ln2_in = lay.ln_mix, lay.ln_out, lt.ln_out_in
    if ln2_in is None:
        raise RuntimeError("globenc needs a trace captured with ffn=True")
    assert ln2 is not None  # post-LN layers have LN2

    def p(v: torch.Tensor) -> torch.Tensor:
        return ln2.project(ln1.project(v))

    return p, 1.0 / (ln1.scale(lt.mix_in.float()) * ln2.scale(ln2_in.float()))


@torch.no_grad()
def globenc_vectors(trace: Trace, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decomposed LN2 outputs of a post-LN layer: (v [B, n(target), n(source), d], rest [B, n, d]) with
    Σ_j v_ij + rest_i = real layer output; `rest` = g2(g1(b_O) + β1) + g2(FFN) + β2. Materialises n² vectors:
    for checks and small inputs."""
    lt, lay = trace.layers[index], trace.adapter.layers[index]
    p, inv = _maps(lt, lay)
    pf = p(head_vectors(lt, lay))  # [B, H, n, d]
    v = torch.einsum("bhij,bhjd->bijd", lt.alpha.float(), pf)
    v.diagonal(dim1=1, dim2=2).add_(p(lt.x.float()).transpose(1, 2))
    v = v * inv[:, :, None, None]
    rest = _rest(lt, lay, inv)
    return v, rest


def _rest(lt: LayerTrace, lay: Layer, inv: torch.Tensor) -> torch.Tensor:
    """g2(g1(b_O) + β1) + g2(FFN output) + β2: [B, n, d]."""
    ln1, ln2, ln2_in = lay.ln_mix, lay.ln_out, lt.ln_out_in
    assert ln2 is not None and ln2_in is not None  # post-LN, traced with ffn=True
    s2 = ln2.scale(ln2_in.float())[..., None]
    b_o = lay.b_o.float() if lay.b_o is not None else lt.x.new_zeros(lt.x.shape[-1])
    bias1 = ln2.project(ln1.project(b_o)) * inv[..., None] + ln2.project(ln1.shift().float()) / s2
    ffn = ln2_in.float() - lt.mix_out.float()
    return bias1 + ln2.project(ffn) / s2 + ln2.shift().float()


def layer_fn(
    lt: LayerTrace, lay: Layer, mask: torch.Tensor, index: int
) -> Callable[[torch.Tensor | None], torch.Tensor]:
    """N-Enc of one post-LN layer after its self-check, as a function of target positions rows [B, K] → [B, K, n]
    (None: every row, [B, n, n]; unmasked)."""
    p, inv = _maps(lt, lay)
    alpha, x = lt.alpha.float(), lt.x.float()
    pf = projected_head_vectors(lt, lay, p)  # [B, H, n, d]
    gram = torch.einsum("bhjd,bgjd->bjhg", pf, pf)
    t_ii = (torch.einsum("bhi,bhid->bid", alpha.diagonal(dim1=2, dim2=3), pf) + p(x)).norm(dim=-1)  # [B, n]
    # self-check: the decomposition plus the unattributed terms must rebuild the real layer output
    rebuilt = p(attn_sum(lt, lay) + x) * inv[..., None] + _rest(lt, lay, inv)
    assert lt.out is not None  # a full trace
    err = ((rebuilt - lt.out.float()).abs() * mask[..., None]).amax()
    scale = lt.out.float().abs().amax().clamp_min(1.0)
    limit = tolerance(lay.module)
    if not err <= limit * scale:
        raise ReconstructionError(
            f"layer {index}: GlobEnc's decomposition differs from the real layer output by {err.item():.3g} "
            f"(tolerance {limit * scale.item():.3g})"
        )

    def rows_of(rows: torch.Tensor | None) -> torch.Tensor:
        if rows is None:
            out = quad_norm(alpha, gram)
            out.diagonal(dim1=1, dim2=2).copy_(t_ii)
            return out * inv[:, :, None]
        out = quad_norm(alpha_rows(alpha, rows), gram)
        out.scatter_(2, rows[:, :, None], t_ii.gather(1, rows)[:, :, None])
        return out * inv.gather(1, rows)[:, :, None]

    return rows_of


def _layer_rows(trace: Trace, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Layer `index`'s N-Enc rows: positions rows [B, K] → [B, K, n], padding 0."""
    if trace.adapter.family.pre_ln:
        return lambda rows: pair_rows(trace, index, rows).n_res[:, 0] * row_pair_mask(trace.mask, rows)
    fn = layer_fn(trace.layers[index], trace.adapter.layers[index], trace.mask, index)
    return lambda rows: fn(rows) * row_pair_mask(trace.mask, rows)


GLOBENC = "globenc"  # memo key of the per-layer N-Enc matrices, and the key of what the layer sink keeps


@torch.no_grad()
def n_enc(trace: Trace) -> torch.Tensor:
    """Per-layer N-Enc matrices [B, L, n, n], or their target rows [B, L, K, n] in row mode (cached on the
    trace)."""
    memo = memo_of(trace)
    mats: torch.Tensor | None = memo.get(GLOBENC)
    if mats is None:
        targets = rows_of(trace)
        kept, streamed = memo.layer_rows.get(GLOBENC), kept_matrices(trace, GLOBENC)
        if targets is not None and kept is not None:
            mats = torch.stack(kept, dim=1)
        elif targets is not None and streamed is not None:
            mats = torch.stack([streamed(m)(targets) for m in range(len(trace.layers))], dim=1)
        elif targets is not None and trace.adapter.family.pre_ln:  # N-Res: the norm engine's target rows
            mats = block_norms(trace).n_res * row_pair_mask(trace.mask, targets)[:, None]
        elif targets is not None:
            mats = torch.stack([_layer_rows(trace, i)(targets) for i in range(len(trace.layers))], dim=1)
        elif trace.adapter.family.pre_ln:
            mats = block_norms(trace).n_res * pair_mask(trace.mask)
        else:
            mats = torch.stack(
                [
                    layer_fn(lt, lay, trace.mask, i)(None)
                    for i, (lt, lay) in enumerate(zip(trace.layers, trace.adapter.layers, strict=True))
                ],
                dim=1,
            )
            mats = mats * pair_mask(trace.mask)
        memo.put(GLOBENC, mats)
    return mats


def stream_layer(s: StreamLayer, whole: bool) -> None:
    """The layer sink of a streamed trace (`registry.Stream`). Post-LN: this layer's N-Enc target rows, or for the
    rollout (`whole`) its whole matrix. Pre-LN, N-Enc is N-Res: the norm engine streams its target rows, and for
    the rollout gives the function of any rows (`StreamLayer.n_res`)."""
    mask = s.mask
    if s.family.pre_ln:
        if s.n_res is not None:
            s.keep_fn(GLOBENC, _masked(s.n_res, mask))
        return
    fn = layer_fn(s.lt, s.layer, mask, s.index)
    if whole:
        s.keep_fn(GLOBENC, gathered(fn(None) * pair_mask(mask)[:, 0]))
    else:
        s.keep(GLOBENC, fn(s.rows) * row_pair_mask(mask, s.rows))


def _masked(rows_of: RowsFn, mask: torch.Tensor) -> Callable[[], RowsFn]:
    """The factory of `rows_of`'s rows with padding pairs zeroed."""
    return lambda: lambda r: rows_of(r) * row_pair_mask(mask, r)


def _pre_ln(family: Family) -> bool:
    return family.pre_ln


def _post_ln(family: Family) -> bool:
    return not family.pre_ln


@register(
    "globenc",
    needs_ffn=True,
    supports=vector_block,
    row_mode=True,
    stream=Stream(GLOBENC, stream_layer, norm_run=_pre_ln, capture=_post_ln),
    default_in={"html": 3},
    card=Card(
        definition="N-Enc_ij = ‖g2_i(g1_i(t_ij))‖, LN1 then LN2 as linear maps at target i (Modarressi et al. 2022); "
        "pre-LN models: ‖t_ij‖.",
        passes="One traced forward pass with the FFN captured, no backward; every call checks that the decomposition "
        "rebuilds the real layer output.",
        memory="[L, n, n]; with --rows only the requested rows ([L, t, n]).",
        note="the unnormalised scale follows the official code's, but no values were compared",
        background=BACKGROUND,
    ),
)
def globenc(trace: Trace) -> torch.Tensor:
    """GlobEnc N-Enc per layer: ‖LN2∘LN1 (attention + residual)‖ (Modarressi 2022); pre-LN models: ‖t_ij‖."""
    return n_enc(trace)


@register(
    "globenc_rollout",
    needs_ffn=True,
    supports=vector_block,
    row_mode=True,
    explains=True,
    unnormalised=True,
    stream=Stream(GLOBENC, stream_layer, whole=True, norm_run=_pre_ln, capture=_post_ln),
    options=(Option("normalize", bool, False, help="scale the rows of every layer's N-Enc to 1 before the product"),),
    card=Card(
        definition="R_l = N_l R_{l−1}, the plain product of the N-Enc matrices (normalize=true: each layer's rows "
        "scaled to 1 first).",
        passes="One traced forward pass with the FFN captured, no backward.",
        memory=ROLLOUT_MEMORY + "; a layer is divided by a power of two only where it leaves [2⁻⁶⁴, 2⁶⁴].",
        background=BACKGROUND,
    ),
)
def globenc_rollout(trace: Trace, *, normalize: bool = False) -> torch.Tensor:
    """GlobEnc global attribution: rollout of N-Enc over layers 1..l (normalize=true: rows to 1 first)."""
    targets = rows_of(trace)
    if targets is not None:
        layer_rows = kept_matrices(trace, GLOBENC) or (lambda m: _layer_rows(trace, m))
        return rollout_rows(trace, layer_rows, targets, normalize=normalize)
    return rollout(n_enc(trace), normalize=normalize)
