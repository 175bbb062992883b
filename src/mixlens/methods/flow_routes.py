"""Information-flow routes (Ferrando & Voita 2024, "Information Flow Routes: Automatically Interpreting Language
Models at Scale"): the subgraph of important edges that built one prediction, found top-down (docs/reference/global.md,
"Information-flow routes").

The graph of a pre-LN decoder. Nodes are residual-stream vectors: x^l_i (after layer l at position i; x^{-1}_i the
embedding), the stream after layer l's attention m^l_i (`mix_in`, the input of the norm before the FFN) and the FFN
node of (l, i). Each node is a sum of edge vectors, checked against the trace's real tensors on every run:

- attention:  m^l_i = x^{l-1}_i + Σ_j z^l_ij + b_O,   z^l_ij = Σ_h α^h_ij f^h(x^{l-1}_j)  (per head: z^{l,h}_ij)
              edges: token j → i through the attention (one per source, or one per head and source), and the
              residual x^{l-1}_i → m^l_i. Gemma's sandwich norm is linear once its scale s^post_i is fixed:
              α / s^post and γ_post W_O (`LayerTrace.alpha_mix`, the adapter's W_O), so its edges are exact too.
- FFN:        x^l_i = m^l_i + F^l_i,   F^l_i the FFN output (Gemma: after its post-FFN norm);
              edges: the FFN node m^l_i → F → x^l_i and the residual m^l_i → x^l_i.

Importance of an edge e into a node y whose edge vectors are {e_k} (the paper's proximity, as ALTI's, computed as
the authors' tool computes it): proximity(e, y) = max(ε, ‖y‖₁ − ‖e − y + δ‖₁), importance = proximity /
Σ_k proximity(e_k, y); the attention edges are per head and source (`per_head`, default, as the paper and the tool),
ε = 1e-5 as the tool clips it, δ = 1e-6 the constant torch's `pairwise_distance` adds inside the tool's distance
(`distance_eps`; 0: the plain norm). The value bias is the tool's too (`value_bias="bias"`): b_V's share Σ_j α_ij
b_V W_O joins b_O, part of y but no edge (`"values"`: b_V stays in each source's value vector f^h(x_j)). Top-down
from x^{L-1}_p (p: the prediction's position), an edge is kept when its importance exceeds τ and the kept edges into
a node are renormalised to sum to 1 (`renormalize`, the tool's default; a token edge is then the sum of its heads'
kept edges); without `renormalize` the threshold is the tool's graph filter: on the token edge j → i summed over
heads, and for j = i on that edge plus the residual (the tool's graph holds them as one edge). A node is kept when
a kept edge leaves it; only the kept nodes' edges are computed. Reference: facebookresearch/llm-transparency-tool
(docs/reference/global.md).

Shapes at the boundary (B batch, L layers, H heads, n tokens; padding and edges outside the graph are 0):

- values   [B, L, n(target), n(source)]  attention edge j → i of layer l (heads=True: [B, L, H, n, n], per head)
- extras   residual [B, L, n]: attention-block residual edge x^{l-1}_i → m^l_i; ffn [B, L, n]: FFN edge;
           ffn_residual [B, L, n]: FFN-block residual edge m^l_i → x^l_i; nodes [B, L, n]: 1 where x^l_i is in the
           graph; inputs [B, n]: 1 where the embedding x^{-1}_j is; tokens [B, n]: the route score of each input
           token (below); position [B]: the prediction's position p; error [B]: the largest reconstruction error
           of the kept nodes, relative to max(1, max |real node|).
- route score of token j: the sum over every route of kept edges from x^{-1}_j to x^{L-1}_p of the product of the
  importances along it (an FFN node passes its edge's importance on). With τ → 0 the scores sum to 1; with τ the
  share of the prediction's importance left outside the graph is lost. `flow_routes_tokens` returns it [B, n].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixlens.adapters import Family, Layer
from mixlens.errors import MixlensError, ReconstructionError
from mixlens.methods.engine import TOLERANCE, tolerance
from mixlens.methods.registry import LHTS, TRACED, Card, MethodOutput, Option, register
from mixlens.targets import model_kind, positions
from mixlens.trace import LayerTrace, Trace, repeat_kv

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("global.md", "information-flow routes")
FLOW_CHECK = (
    "tests/methods/test_flow_routes.py::test_equals_the_authors_tool_end_to_end (the tool's stored output) and "
    "::test_equals_the_authors_tool (live, when MIXLENS_LLM_TT names the tool)"
)

TAU = 0.04  # the contribution threshold of the authors' tool (its default) and of the paper's Llama 2 graphs
EPS = 1e-5  # the smallest proximity, as the authors' tool clips it before normalising
DISTANCE_EPS = 1e-6  # added inside the tool's distance ‖e − y + δ‖₁ (torch.nn.functional.pairwise_distance's eps)
CHUNK_ELEMENTS = 1 << 22  # floats of edge vectors held at once (16 MB)
EXTRAS = {
    "residual": ("layer", "target"),
    "ffn": ("layer", "target"),
    "ffn_residual": ("layer", "target"),
    "nodes": ("layer", "target"),
    "inputs": ("source",),
    "tokens": ("source",),
    "position": (),
    "error": (),
}


def pre_ln_stream(family: Family) -> str | None:
    """The routes follow a pre-LN residual stream, x + Attn + FFN, whose nodes are sums of edge vectors."""
    if not family.pre_ln:
        return (
            "information-flow routes follow a pre-LN residual stream (x + Attn(LN(x)) + FFN); a post-LN block "
            "renormalises each sum, so its nodes are not sums of edge vectors"
        )
    if family.parallel:
        return (
            "information-flow routes follow a sequential stream x → x + Attn → + FFN(LN(·)); in a parallel block the "
            "FFN reads the layer input, not the stream after attention"
        )
    return None


TAU_OPTION = Option(
    "tau",
    float,
    TAU,
    min=0.0,
    max=1.0,
    open=True,
    help="importance threshold τ in (0, 1): an edge is kept when its importance exceeds τ (0.04 as in the paper)",
)
POSITION_OPTION = Option(
    "position",
    int,
    None,
    min=0,
    optional=True,
    help="position of the explained prediction (default: a causal LM's last token; an encoder's [MASK], or [CLS])",
)


PER_HEAD_OPTION = Option(
    "per_head",
    bool,
    True,
    help="an attention edge's importance per head and source, as the paper and its tool (false: per source)",
)
RENORMALIZE_OPTION = Option(
    "renormalize",
    bool,
    True,
    help="scale the kept edges into each node to sum to 1 after the threshold, as the authors' tool by default "
    "(false: the tool's threshold on the head-summed edges)",
)
VALUE_BIAS_OPTION = Option(
    "value_bias",
    str,
    "bias",
    choices=("bias", "values"),
    help="b_V's share joins b_O, no edge, as the authors' tool (bias), or stays in each source's value vector (values)",
)
DISTANCE_EPS_OPTION = Option(
    "distance_eps",
    float,
    DISTANCE_EPS,
    min=0.0,
    max=1e-3,
    help="δ inside the distance ‖e − y + δ‖₁ (1e-6: torch's pairwise_distance, as the authors' tool; 0: plain norm)",
)
OPTIONS = (TAU_OPTION, POSITION_OPTION, PER_HEAD_OPTION, RENORMALIZE_OPTION, VALUE_BIAS_OPTION, DISTANCE_EPS_OPTION)


@dataclass
class Routes:
    """The graph of one input with m real tokens (see the module docstring for the meaning of each field)."""

    edges: torch.Tensor | None  # [L, m, m] or [L, H, m, m]; None when not asked for (the token scores alone)
    residual: torch.Tensor  # [L, m]
    ffn: torch.Tensor  # [L, m]
    ffn_residual: torch.Tensor  # [L, m]
    nodes: torch.Tensor  # [L, m]
    inputs: torch.Tensor  # [m]
    tokens: torch.Tensor  # [m]
    error: float


def _check_tau(method: str, tau: float) -> None:
    if not 0.0 < tau < 1.0:
        raise MixlensError(
            f"option {method}.tau must be a number in (0, 1), got {tau!r} (τ = 0 would keep every edge, 1 none)"
        )


def _check(err: torch.Tensor, real: torch.Tensor, what: str, layer: int, limit: float = TOLERANCE) -> float:
    """Relative error of one block's kept nodes; ReconstructionError past `limit` (the engine's tolerance for the
    model's dtype)."""
    rel = float(err.abs().max()) / max(1.0, float(real.abs().max())) if err.numel() else 0.0
    if not rel <= limit:  # NaN fails too
        raise ReconstructionError(
            f"layer {layer}: the {what} edge vectors differ from the real residual stream by {rel:.3g} (relative; "
            f"tolerance {limit:.3g}); the adapter for this architecture does not match the model"
        )
    return rel


def _proximity(y: torch.Tensor, e: torch.Tensor, delta: float = DISTANCE_EPS) -> torch.Tensor:
    """max(ε, ‖y‖₁ − ‖e − y + δ‖₁) over the last axis (ε = `EPS`, δ = `DISTANCE_EPS`: the authors' tool's
    `pairwise_distance(e, y)`); y broadcasts against e."""
    return (y.abs().sum(-1) - (e - y + delta).abs().sum(-1)).clamp_min(EPS)


def _renormalised(parts: torch.Tensor, rest: torch.Tensor, tau: float, renormalize: bool, dims: tuple[int, ...]):
    """Importances of the edges into a set of nodes, `parts` (the blocks' edges, summed over `dims` per node) and
    `rest` (the residual edge) after the threshold: those ≤ τ set to 0, and with `renormalize` the kept ones of a node
    scaled to sum to 1 (the authors' tool's `apply_threshold_and_renormalize`)."""
    parts, rest = parts * (parts > tau), rest * (rest > tau)
    if renormalize:
        total = ((parts.sum(dims) if dims else parts) + rest).clamp_min(torch.finfo(rest.dtype).tiny)
        shape = list(parts.shape)
        for d in dims:
            shape[d] = 1
        parts, rest = parts / total.reshape(shape), rest / total
    return parts, rest


def _graph_threshold(
    imp: torch.Tensor, imp_res: torch.Tensor, rows: torch.Tensor, tau: float, per_head: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' tool's threshold without renormalisation (`build_paths_to_predictions` on the graph of
    `build_full_graph`): a token edge j → i is kept when its importance summed over heads exceeds τ; the edge i → i
    and the residual x^{l-1}_i → m^l_i are one edge of that graph, kept together when their sum exceeds τ.
    imp [H, K, m] (`per_head`) or [K, m], imp_res [K], rows [K] the targets i → the kept importances, unscaled."""
    token = imp.sum(0) if per_head else imp  # [K, m]
    k = torch.arange(len(rows), device=rows.device)
    merged = token[k, rows] + imp_res  # [K]: the tool's edge x^{l-1}_i → m^l_i
    keep = token > tau
    keep[k, rows] = merged > tau
    return imp * keep, imp_res * (merged > tau)


def _ffn_update(lt: LayerTrace, lay: Layer, b: int, rows: torch.Tensor, family: Family) -> torch.Tensor:
    """F^l_i of the rows [K] of input b: the FFN's last projection's captured output (`ffn="update"`; a trace with
    the FFN activations: that projection applied to them), then Gemma's post-FFN norm, as the model computes it →
    [K, d]. The block's check x^l = m^l + F^l then tests the adapter's reading of the block."""
    dtype = next(lay.ffn_out.parameters()).dtype  # the model's own dtype (captures are float32)
    if lt.ffn_update is not None and lt.ffn_update.numel():
        out = lt.ffn_update[b, rows].to(dtype)
    else:
        assert lt.ffn_act is not None, "flow routes need the FFN's output (needs_ffn='update')"
        act = lt.ffn_act[b : b + 1, rows].to(dtype)  # [1, K, d_ff]: a mixture-of-experts block reads [B, n, d]
        out = lay.ffn_out(act)[0] * lay.branch_scale
    if family.ln_post is not None:
        out = getattr(lay.module, "post_feedforward_layernorm")(out)  # noqa: B009  (Gemma 2/3's name)
    return out.float()


def _attention_rows(
    lt: LayerTrace,
    lay: Layer,
    b: int,
    rows: torch.Tensor,
    m: int,
    heads: bool,
    layer: int,
    limit: float = TOLERANCE,
    value_bias: str = "bias",
    delta: float = DISTANCE_EPS,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Importances of the attention edges into m^l_i for the rows i [K] of input b: (edges [K, m] or [H, K, m],
    residual [K], relative error). The edge vectors are built in chunks of rows and checked against `mix_in`.
    `value_bias="bias"`: b_V leaves the value vectors and Σ_j α_ij b_V W_O joins b_O (the tool's folding)."""
    v = repeat_kv(lt.value[b : b + 1, :, :m], lay.n_heads)[0].float()  # [H, m, d_h]
    w = lay.w_o.float().reshape(lay.n_heads, lay.d_head, -1)
    b_v = None
    if value_bias == "bias" and lay.b_v is not None:
        b_v = lay.b_v.float().view(lay.n_kv_heads, lay.d_head).repeat_interleave(lay.n_heads // lay.n_kv_heads, 0)
        v = v - b_v[:, None]
    f = torch.einsum("hjk,hkd->hjd", v, w)  # [H, m, d]  f^h(x_j) (γ_post folded in with a sandwich norm)
    hn, _, d = f.shape
    b_vw = None if b_v is None else torch.einsum("hk,hkd->hd", b_v, w)  # [H, d]  b_V^h W_O^h
    bias = lay.b_o.float() if lay.b_o is not None else f.new_zeros(d)
    k = len(rows)
    edges = f.new_zeros((hn, k, m) if heads else (k, m))
    residual = f.new_zeros(k)
    worst = 0.0
    per_row = m * d * (hn if heads else 1)
    step = max(1, CHUNK_ELEMENTS // per_row)
    for s in range(0, k, step):
        r = rows[s : s + step]
        a = lt.alpha_rows(r, mix=True, b=b)[:, :, :m]  # [H, k', m]: α / s^post (from q and K in row mode)
        y = lt.mix_in[b, r].float()  # [k', d]
        x = lt.x[b, r].float()
        if heads:
            z = a[..., None] * f[:, None]  # [H, k', m, d]
            total = z.sum((0, 2))
            prox = _proximity(y[None, :, None], z, delta)  # a zero weight (causal mask, window): counted, as the tool
            denom_edges = prox.sum((0, 2))
        else:
            z = torch.einsum("hkj,hjd->kjd", a, f)  # [k', m, d]
            total = z.sum(1)
            prox = _proximity(y[:, None], z, delta)
            denom_edges = prox.sum(1)
        row_bias = bias if b_vw is None else bias + a.sum(-1).T @ b_vw  # [k', d]  b_O (+ Σ_j α_ij b_V W_O)
        worst = max(worst, _check(x + total + row_bias - y, y, "attention", layer, limit))
        prox_res = _proximity(y, x, delta)
        denom = (denom_edges + prox_res).clamp_min(torch.finfo(y.dtype).tiny)
        if heads:
            edges[:, s : s + step] = prox / denom[None, :, None]
        else:
            edges[s : s + step] = prox / denom[:, None]
        residual[s : s + step] = prox_res / denom
    return edges, residual, worst


@torch.no_grad()
def input_routes(
    trace: Trace,
    b: int,
    position: int,
    tau: float,
    heads: bool,
    per_head: bool = True,
    renormalize: bool = True,
    edges: torch.Tensor | bool = True,
    value_bias: str = "bias",
    distance_eps: float = DISTANCE_EPS,
) -> Routes:
    """The routes of input b to its prediction at `position`, top-down (see the module docstring). `per_head`: an
    attention edge's importance per head and source (the paper's and the tool's), else per source (the head-summed
    vector); `heads`: edges returned per head (implies `per_head`); `renormalize`: the kept edges into a node scaled
    to sum to 1 after the threshold (the tool's default; else the tool's threshold on the head-summed edges).
    `edges`: True to return the kept edges [L, m, m] (`heads`: [L, H, m, m]), zeros of that shape to write them into
    (e.g. a view of the method's output), False not to keep them (`Routes.edges` None: the token scores need only the
    walk). `value_bias`, `distance_eps`: the tool's conventions by default (module docstring)."""
    per_head = per_head or heads
    m = int(trace.mask[b].sum())
    fam = trace.adapter.family
    limit = tolerance(trace.model)
    n_layers, hn, dev = len(trace.layers), trace.adapter.n_heads, trace.mask.device
    if edges is True:
        edges = torch.zeros((n_layers, hn, m, m) if heads else (n_layers, m, m), device=dev)
    kept_edges = edges if isinstance(edges, torch.Tensor) else None
    residual, ffn, ffn_res, nodes = (torch.zeros(n_layers, m, device=dev) for _ in range(4))
    kept = torch.zeros(m, dtype=torch.bool, device=dev)  # output nodes x^l_i of the layer being walked
    kept[position] = True
    weight = torch.zeros(m, device=dev)  # route weight of each kept node to the prediction
    weight[position] = 1.0
    worst = 0.0
    for layer in reversed(range(n_layers)):
        lt, lay = trace.layers[layer], trace.adapter.layers[layer]
        if lt.out is None:
            raise MixlensError("flow routes need the whole forward pass (a trace with the last layer's output)")
        rows = kept.nonzero()[:, 0]
        nodes[layer, rows] = 1.0
        # FFN block: x^l_i = m^l_i + F^l_i
        mid, upd, real = lt.mix_in[b, rows].float(), _ffn_update(lt, lay, b, rows, fam), lt.out[b, rows].float()
        worst = max(worst, _check(mid + upd - real, real, "FFN", layer, limit))
        p_ffn, p_res = _proximity(real, upd, distance_eps), _proximity(real, mid, distance_eps)
        denom = p_ffn + p_res
        i_ffn, i_res = _renormalised(p_ffn / denom, p_res / denom, tau, renormalize, ())
        ffn[layer, rows], ffn_res[layer, rows] = i_ffn, i_res
        weight[rows] = weight[rows] * (i_ffn + i_res)  # now the weight of m^l_i
        rows = rows[(i_ffn > 0) | (i_res > 0)]  # the kept m^l_i
        # attention block: m^l_i = x^{l-1}_i + Σ_j z_ij + b_O
        imp, imp_res, err = _attention_rows(lt, lay, b, rows, m, per_head, layer, limit, value_bias, distance_eps)
        worst = max(worst, err)
        if renormalize:
            imp, imp_res = _renormalised(imp, imp_res, tau, True, (0, 2) if per_head else (1,))
        else:
            imp, imp_res = _graph_threshold(imp, imp_res, rows, tau, per_head)
        token_edges = imp.sum(0) if per_head else imp  # [K, m]: a token edge is the sum of its heads' edges
        if kept_edges is not None and heads:
            kept_edges[layer, :, rows] = imp
        elif kept_edges is not None:
            kept_edges[layer, rows] = token_edges
        residual[layer, rows] = imp_res
        w_mid = weight[rows]
        weight = w_mid @ token_edges  # [m]: Σ_i w(m_i) · importance of j → i
        weight[rows] += w_mid * imp_res
        kept = (token_edges > 0).any(0)
        kept[rows[imp_res > 0]] = True
    return Routes(kept_edges, residual, ffn, ffn_res, nodes, kept.float(), weight, worst)


def _positions(trace: Trace, position: int | None) -> torch.Tensor:
    """The explained position of each input [B]: a causal LM's last token; an encoder's (ModernBERT) first [MASK] of
    a masked LM, else its first token ([CLS], what its classifier reads)."""
    kind = "causal" if trace.adapter.family.causal else model_kind(trace.model)
    return positions(kind, trace.inputs, trace.tokenizer, position)


def routes(
    trace: Trace,
    *,
    heads: bool,
    tau: float,
    position: int | None,
    method: str = "flow_routes",
    per_head: bool = True,
    renormalize: bool = True,
    edges: torch.Tensor | bool = True,
    value_bias: str = "bias",
    distance_eps: float = DISTANCE_EPS,
) -> list[Routes]:
    """The routes of every input of the trace ([Routes], one per input; options as `input_routes`); `edges`: True
    (each Routes keeps its own), zeros [B, L, n, n] (`heads`: [B, L, H, n, n]) to receive them, or False."""
    _check_tau(method, tau)
    pos = _positions(trace, position)
    return [
        input_routes(
            trace,
            b,
            int(pos[b]),
            tau,
            heads,
            per_head,
            renormalize,
            edges[b, ..., :m, :m] if torch.is_tensor(edges) else edges,
            value_bias,
            distance_eps,
        )
        for b, m in enumerate(trace.mask.sum(1).tolist())
    ]


@register(
    "flow_routes",
    default_in={"routes": 0},
    head_dims=LHTS,
    needs_ffn="update",
    options=OPTIONS,
    extras=EXTRAS,
    supports=pre_ln_stream,
    qk_rows=True,
    card=Card(
        definition="Edge importance = max(ε, ‖y‖₁ − ‖e − y + δ‖₁) / Σ_k max(ε, ‖y‖₁ − ‖e_k − y + δ‖₁) for each edge "
        "vector e of node y (per head and source, residual, FFN), kept above τ top-down from the prediction "
        "(Ferrando & Voita 2024).",
        passes=TRACED + " (keeping only the FFN output).",
        memory="α read by rows; output [L, n, n] (per head [L, H, n, n]).",
        official="facebookresearch/llm-transparency-tool (`routes/contributions.py`, `routes/graph.py`, run unchanged)",
        tolerance="raw shares: measured 5.5e-6, asserted 1e-5; pruned graphs (τ 0.04 and 0.1): the same edges, "
        "weights to 1e-5; live: atol 1e-5, rtol 1e-4",
        check=FLOW_CHECK,
        background=BACKGROUND,
    ),
)
def flow_routes(
    trace: Trace,
    *,
    heads: bool = False,
    tau: float = TAU,
    position: int | None = None,
    per_head: bool = True,
    renormalize: bool = True,
    value_bias: str = "bias",
    distance_eps: float = DISTANCE_EPS,
) -> MethodOutput:
    """Information-flow routes (Ferrando & Voita 2024): importance of the kept edges to one prediction, per layer
    (attention edges j → i; residual and FFN edges in extras)."""
    (bsz, n), dev = trace.mask.shape, trace.mask.device
    n_layers = len(trace.layers)
    values = torch.zeros((bsz, n_layers, trace.adapter.n_heads, n, n) if heads else (bsz, n_layers, n, n), device=dev)
    found = routes(
        trace,
        heads=heads,
        tau=tau,
        position=position,
        per_head=per_head,
        renormalize=renormalize,
        edges=values,  # the edges written into `values` in place
        value_bias=value_bias,
        distance_eps=distance_eps,
    )
    extras = {
        k: torch.zeros(bsz, *(n_layers if a == "layer" else n for a in axes), device=dev) for k, axes in EXTRAS.items()
    }
    for b, r in enumerate(found):
        m = len(r.tokens)
        for key, t in (("residual", r.residual), ("ffn", r.ffn), ("ffn_residual", r.ffn_residual), ("nodes", r.nodes)):
            extras[key][b, :, :m] = t
        extras["inputs"][b, :m], extras["tokens"][b, :m] = r.inputs, r.tokens
        extras["error"][b] = r.error
    extras["position"] = _positions(trace, position).float().to(dev)
    return MethodOutput(values, extras)


@register(
    "flow_routes_tokens",
    dims=("source",),
    needs_ffn="update",
    options=OPTIONS,
    supports=pre_ln_stream,
    explains=True,
    qk_rows=True,
    card=Card(
        definition="Score_j = the total importance of the kept routes from input token j to the explained prediction "
        "in the flow_routes graph.",
        passes=TRACED + " (keeping only the FFN output).",
        memory="α read by rows; output [n].",
        note="the authors' tool gives no per-token score; the graph it sums is flow_routes', compared with the tool",
        background=BACKGROUND,
    ),
)
def flow_routes_tokens(
    trace: Trace,
    *,
    tau: float = TAU,
    position: int | None = None,
    per_head: bool = True,
    renormalize: bool = True,
    value_bias: str = "bias",
    distance_eps: float = DISTANCE_EPS,
) -> torch.Tensor:
    """Information-flow routes per input token: the total importance of the kept routes from each token to the
    prediction (Σ over routes of the product of edge importances)."""
    found = routes(
        trace,
        heads=False,
        tau=tau,
        position=position,
        method="flow_routes_tokens",
        per_head=per_head,
        renormalize=renormalize,
        edges=False,  # the walk alone: no [L, n, n] of edges
        value_bias=value_bias,
        distance_eps=distance_eps,
    )
    out = torch.zeros(trace.mask.shape, device=trace.mask.device)
    for b, r in enumerate(found):
        out[b, : len(r.tokens)] = r.tokens
    return out
