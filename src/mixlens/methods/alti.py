"""ALTI (Ferrando et al. 2022; DESIGN §3.5): L1-distance contributions per layer and their rollout.

Post-LN: T_i(x_j) = g_i(t_ij) = P1(t_ij)/s1_i and y_i = the real LN1 output, so y_i = Σ_j T_i(x_j) + g_i(b_O) + β
exactly. Pre-LN (GPT-2, Llama): the residual path has no norm, so T_i(x_j) = t_ij and y_i = the real residual sum
x_i + attention output. Contribution c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), rows normalised to 1.
The L1 rule needs the vectors T_i(x_j); they are built in chunks of target rows to bound memory.
"""

from __future__ import annotations

import torch

from mixlens.adapters import Layer
from mixlens.methods.norms import head_vectors
from mixlens.methods.registry import register
from mixlens.methods.rollout import pair_mask, rollout, row_normalize
from mixlens.trace import LayerTrace, Trace

ROW_CHUNK_ELEMENTS = 1 << 24  # floats of T vectors held at once (64 MB)


def _maps(lt: LayerTrace, lay: Layer, pre_ln: bool):
    """(linear map P on [..., d], per-target 1/s [B, n], the real y [B, n, d])."""
    if pre_ln:
        return (lambda v: v), torch.ones(lt.x.shape[:2]), lt.mix_in.float()
    norm = lay.ln_mix
    return norm.project, 1.0 / norm.scale(lt.mix_in.float()), lt.mix_out.float()


@torch.no_grad()
def alti_vectors(trace: Trace, index: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """(T [B, r, n(source), d] for the target rows `rows`, y [B, n, d]) of one layer; Σ_j T_i(x_j) plus the
    bias g_i(b_O) + β (post-LN) or b_O (pre-LN) equals y_i."""
    lt, lay = trace.layers[index], trace.adapter.layers[index]
    p, inv, y = _maps(lt, lay, trace.adapter.family.pre_ln)
    pf = p(head_vectors(lt, lay))  # [B, H, n, d]
    return _rows(lt.alpha.float(), pf, p(lt.x.float()), inv, rows), y


def _rows(alpha: torch.Tensor, pf: torch.Tensor, px: torch.Tensor, inv: torch.Tensor, rows: slice) -> torch.Tensor:
    t = torch.einsum("bhij,bhjd->bijd", alpha[:, :, rows], pf)  # [B, r, n, d]
    start = rows.start or 0
    idx = torch.arange(start, start + t.shape[1])
    t[:, torch.arange(t.shape[1]), idx] += px[:, idx]
    return t * inv[:, rows, None, None]


def _layer(lt: LayerTrace, lay: Layer, pre_ln: bool) -> torch.Tensor:
    p, inv, y = _maps(lt, lay, pre_ln)
    pf = p(head_vectors(lt, lay))
    px = p(lt.x.float())
    alpha = lt.alpha.float()
    b, n, d = y.shape
    out = torch.empty(b, n, n)
    step = max(1, ROW_CHUNK_ELEMENTS // max(1, b * n * d))
    y1 = y.abs().sum(-1)  # [B, n]
    for s in range(0, n, step):
        rows = slice(s, min(n, s + step))
        t = _rows(alpha, pf, px, inv, rows)
        dist = (y[:, rows, None, :] - t).abs_().sum(-1)  # [B, r, n]
        out[:, rows] = (y1[:, rows, None] - dist).clamp_min_(0)
    return out


@torch.no_grad()
def alti_matrices(trace: Trace) -> torch.Tensor:
    """Per-layer ALTI contributions, rows normalised: [B, L, n, n] (cached on the trace)."""
    if "alti" not in trace.cache:
        pre_ln = trace.adapter.family.pre_ln
        mats = torch.stack([_layer(lt, lay, pre_ln) for lt, lay in
                            zip(trace.layers, trace.adapter.layers, strict=True)], dim=1)
        trace.cache["alti"] = row_normalize(mats * pair_mask(trace.mask))
    return trace.cache["alti"]


@register("alti")
def alti(trace: Trace) -> torch.Tensor:
    """ALTI per layer (Ferrando 2022): max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), rows normalised."""
    return alti_matrices(trace)


@register("alti_rollout")
def alti_rollout(trace: Trace) -> torch.Tensor:
    """ALTI global attribution: rollout of the per-layer ALTI matrices over layers 1..l."""
    return rollout(alti_matrices(trace))
