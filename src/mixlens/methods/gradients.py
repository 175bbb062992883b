"""Gradient attributions through the input embeddings (DESIGN §3.7, §4).

- `hta` (Brunner et al. 2020, Hidden Token Attribution): c^l_ij = ‖∂e^l_i/∂x_j‖_F / Σ_k ‖∂e^l_i/∂x_k‖_F,
  e^l = output of layer l, x = the word-piece embeddings (`input="word"`) or the embedding-layer output,
  i.e. the input of the first layer (`input="embedding"`).
- `head_attribution` (Pascual et al. 2021): the same for each head's context vector o^{l,h}_i = Σ_j α^h_ij v^h_j.

Both come from one forward-mode pass: the model is run with a perturbation δ added at the input (the engine's
edit point `embed` or `blocks.0.resid_pre`, so position embeddings and LayerNorm are applied exactly once), and
`torch.func.jvp` under `vmap` pushes a batch of input directions u through it, giving J u for every layer, head
and target at once. Exact mode uses the n·d_in unit directions (chunked); estimate mode uses k Rademacher probes
per source position (Hutchinson: E‖J u‖² = ‖J‖_F²) and keeps their standard error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.func import jvp, vmap

from mixlens.methods.memo import memo_of
from mixlens.methods.registry import LHTS, LTS, Card, MethodOutput, Option, get, register
from mixlens.trace import Edit, Trace, hooked

# The long-form page behind this module's reference cards (in docs/reference/), and what it covers
BACKGROUND = ("gradients.md", "HTA and head attribution")

MAX_PROBES = 256  # estimate mode: running sums per source (memory flat in the probes); time grows with them

INPUTS = ("word", "embedding")
INPUT_POINTS = {"word": "embed", "embedding": "blocks.0.resid_pre"}  # the edit point that adds δ [B, n, d_in]
MODES = ("exact", "estimate")
OPTIONS = (
    Option(
        "input",
        str,
        "word",
        choices=INPUTS,
        help="differentiate w.r.t. the word-piece embeddings or the embedding-layer output",
    ),
    Option("mode", str, "exact", choices=MODES, help="exact: n·d_in JVPs; estimate: Hutchinson probes (with stderr)"),
    Option("probes", int, 16, min=2, max=MAX_PROBES, help="Rademacher probes per source token (estimate mode)"),
    Option("seed", int, 0, min=0, help="probe seed (estimate mode)"),
)
_CHUNK_BUDGET = 2**22  # floats of one tangent activation [chunk, batch, tokens, 4·d] per vmapped call


def input_dim(trace: Trace, where: str) -> int:
    if where == "word":
        return trace.adapter.base.get_input_embeddings().weight.shape[1]
    return trace.layers[0].x.shape[-1]


# Modules whose forward is a torch.autograd.Function that functorch cannot transform (no `setup_context`), with the
# plain function of their own modeling file that gives the same floats (BLOOM's GeLUFunction.forward).
_PLAIN_FORWARD = {"BloomGelu": "bloom_gelu_forward"}


@contextmanager
def _transformable(model: torch.nn.Module) -> Iterator[None]:
    """Within the context, such modules of `model` run their plain function (see `_PLAIN_FORWARD`)."""
    swapped = []
    for m in model.modules():
        plain = _PLAIN_FORWARD.get(type(m).__name__)
        if plain is not None and "forward" not in vars(m):
            m.forward = getattr(sys.modules[type(m).__module__], plain)
            swapped.append(m)
    try:
        yield
    finally:
        for m in swapped:
            del m.forward


def states_fn(trace: Trace, where: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """δ [B, n, d_in] ↦ (layer outputs e [L, B, n, d], head contexts o [L, B, H, n, d_h]) of the base model."""
    adapter, inputs = trace.adapter, trace.inputs

    def f(delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        zs: list[torch.Tensor] = []

        def keep(z: torch.Tensor) -> torch.Tensor:
            zs.append(z)
            return z

        edits: dict[str, Edit] = {f"blocks.{k}.attn.z": keep for k in range(adapter.n_layers)}
        edits[INPUT_POINTS[where]] = lambda t: t + delta
        with _transformable(adapter.base), hooked(adapter, edits) as rec:
            adapter.base(**inputs)
        return torch.stack(rec["out"]), torch.stack(zs)

    return f


@dataclass(frozen=True)
class JacobianKey:
    """What one `jacobian_norms` result depends on (its memo key on the trace)."""

    input: str
    mode: str
    probes: int  # 0 in exact mode
    seed: int
    sources: tuple[int, ...]


@dataclass
class JacobianNorms:
    """Squared Frobenius norms of input Jacobian blocks, [B, L, target, source] and [B, L, H, target, source];
    `*_se` are the standard errors of the estimates (None in exact mode)."""

    hidden: torch.Tensor
    heads: torch.Tensor
    hidden_se: torch.Tensor | None = None
    heads_se: torch.Tensor | None = None


def _push(f: Callable, primal: torch.Tensor, tangents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each direction u in tangents [C, B, n, d_in]: ‖J_e u‖² summed over hidden dims [C, L, B, n] and
    ‖J_o u‖² summed over head dims [C, L, B, H, n]."""

    def one(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        de, do = jvp(f, (primal,), (u,))[1]  # (outputs, output tangents)
        return de.pow(2).sum(-1), do.pow(2).sum(-1)

    return vmap(one)(tangents)


def _chunk(trace: Trace, chunk: int | None) -> int:
    if chunk:
        return chunk
    b, n, d = trace.layers[0].x.shape
    return max(1, min(512, _CHUNK_BUDGET // (b * n * 4 * d)))


def _probe_chunks(
    seed: int, n: int, probes: int, b: int, d_in: int, cols: torch.Tensor, step: int, like: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Estimate mode's Rademacher directions in chunks of at most `step`: (their source columns [C], directions
    u [C, B, n, d_in], each supported on its column). The signs are drawn position by position from one seeded
    generator (the same numbers as one [n, probes, B, d_in] draw), so only one position's [probes, B, d_in] and one
    chunk are held, whatever `probes`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    wanted = set(cols.tolist())
    pending_cols: list[int] = []
    pending: list[torch.Tensor] = []  # [B, d_in] each

    def take(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.tensor(pending_cols[:k], dtype=torch.long)
        u = torch.zeros(k, b, n, d_in, dtype=like.dtype, device=like.device)
        u[torch.arange(k), :, c] = torch.stack(pending[:k]).to(like)
        del pending_cols[:k], pending[:k]
        return c, u

    for j in range(max(wanted) + 1):
        signs = torch.randint(0, 2, (probes, b, d_in), generator=gen) * 2 - 1  # drawn for every position, in order
        if j in wanted:
            pending_cols.extend([j] * probes)
            pending.extend(signs.unbind(0))
        while len(pending) >= step:
            yield take(step)
    if pending:
        yield take(len(pending))


def _mean_se(
    total: torch.Tensor, squares: torch.Tensor, probes: int, cols: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The probes' mean and its standard error (sample standard deviation / √probes) from their running sums
    Σ s and Σ s² [n, ...] (float64); columns not in `cols` stay 0."""
    mean = total / probes
    var = ((squares - probes * mean.pow(2)) / (probes - 1)).clamp_min(0)
    keep = torch.zeros(total.shape[0], dtype=torch.bool)
    keep[cols] = True
    shape = (-1, *(1,) * (total.dim() - 1))
    keep = keep.to(total.device).view(shape)
    return (mean * keep).to(dtype), ((var / probes).sqrt() * keep).to(dtype)


def jacobian_norms(
    trace: Trace,
    *,
    input: str = "word",
    mode: str = "exact",
    probes: int = 16,
    seed: int = 0,
    chunk: int | None = None,
    sources: list[int] | None = None,
    on_chunk: Callable[[float], None] | None = None,
) -> JacobianNorms:
    """‖∂e^l_i/∂x_j‖²_F and ‖∂o^{l,h}_i/∂x_j‖²_F for all layers, heads, targets and sources (padding zeroed).

    Exact: n·d_in JVPs. Estimate: n·probes JVPs with Rademacher probes supported on one source position each.
    `sources` restricts the work to those source positions (other columns stay 0; for benchmarks and sampling).
    `on_chunk(share)`: called as each chunk of JVPs finishes with its share of the work (the shares add up to 1;
    for progress inside a long batch).
    """
    get("hta").check({"input": input, "mode": mode, "probes": probes, "seed": seed})  # the declared options
    key = JacobianKey(input, mode, probes if mode == "estimate" else 0, seed, tuple(sources or ()))
    hit: JacobianNorms | None = memo_of(trace).get(key)
    if hit is not None:
        return hit
    b, n, _ = trace.layers[0].x.shape
    cols = torch.tensor(sources if sources is not None else range(n), dtype=torch.long)
    d_in = input_dim(trace, input)
    param = next(trace.model.parameters())
    primal = torch.zeros(b, n, d_in, dtype=param.dtype, device=param.device)
    f = states_fn(trace, input)
    step = _chunk(trace, chunk)
    with torch.no_grad():  # forward-mode AD ignores grad mode; no autograd graph may chain the chunks together
        if mode == "exact":
            total = len(cols) * d_in  # direction k: unit vector (cols[k // d_in], k % d_in), all inputs
            se_h = se_o = None
            acc_h = acc_o = None
            for k0 in range(0, total, step):
                k = torch.arange(k0, min(total, k0 + step), device=primal.device)
                u = torch.zeros(len(k), b, n, d_in, dtype=primal.dtype, device=primal.device)
                u[torch.arange(len(k)), :, cols[k // d_in], k % d_in] = 1.0
                sh, so = _push(f, primal, u)  # [C, L, B, n], [C, L, B, H, n]
                if on_chunk:
                    on_chunk(len(k) / total)
                if acc_h is None or acc_o is None:
                    acc_h = sh.new_zeros(n, *sh.shape[1:])
                    acc_o = so.new_zeros(n, *so.shape[1:])
                acc_h.index_add_(0, cols[k // d_in], sh)
                acc_o.index_add_(0, cols[k // d_in], so)
            assert acc_h is not None and acc_o is not None  # at least one source column
            sq_h, sq_o = acc_h, acc_o  # [n(source), L, B, n(target)], [n(source), L, B, H, n(target)]
        else:  # running sums per source column: memory flat in the probes (no [n, probes, ...] samples kept)
            sums: list[torch.Tensor] = []  # Σ s and Σ s² of hidden [n, L, B, n] and heads [n, L, B, H, n] (float64)
            for c, u in _probe_chunks(seed, n, probes, b, d_in, cols, step, primal):
                sh, so = _push(f, primal, u)  # [C, L, B, n], [C, L, B, H, n]
                if on_chunk:
                    on_chunk(len(c) / (len(cols) * probes))
                if not sums:
                    sums = [x.new_zeros(n, *x.shape[1:], dtype=torch.float64) for x in (sh, sh, so, so)]
                for acc, x in zip(sums, (sh, sh.pow(2), so, so.pow(2)), strict=True):
                    acc.index_add_(0, c, x.double())
            sq_h, se_h = _mean_se(sums[0], sums[1], probes, cols, primal.dtype)
            sq_o, se_o = _mean_se(sums[2], sums[3], probes, cols, primal.dtype)
    mask = trace.mask.to(primal.dtype)

    def arrange(t: torch.Tensor, heads: bool) -> torch.Tensor:
        t = t.permute(2, 1, 3, 4, 0) if heads else t.permute(2, 1, 3, 0)  # → [B, L, (H,) target, source]
        extra = (None,) * (2 if heads else 1)
        return t.detach() * mask[(slice(None), *extra, slice(None), None)] * mask[(slice(None), *extra, None)]

    out = JacobianNorms(
        arrange(sq_h, False),
        arrange(sq_o, True),
        None if se_h is None else arrange(se_h, False),
        None if se_o is None else arrange(se_o, True),
    )
    return memo_of(trace).put(key, out)


def shares(sq: torch.Tensor, se: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of r = sqrt(‖J‖²_F) normalised over sources: c_ij = r_ij / Σ_k r_ik ([..., target, source]).

    With the standard errors `se` of the squared norms, also the delta-method standard error of c (sources are
    estimated with independent probes): Var c_j = Σ_k (([j=k] − c_j)/R)² Var r_k, Var r_k = Var S_k / (4 S_k).
    """
    r = sq.clamp_min(0).sqrt()
    total = r.sum(-1, keepdim=True)
    c = torch.where(total > 0, r / total.clamp_min(1e-30), torch.zeros_like(r))
    if se is None:
        return c, None
    var_r = torch.where(sq > 0, se.pow(2) / (4 * sq.clamp_min(1e-30)), torch.zeros_like(sq))
    big_r = total.clamp_min(1e-30)
    var_c = ((1 - 2 * c) * var_r + c.pow(2) * var_r.sum(-1, keepdim=True)) / big_r.pow(2)
    return c, torch.where(total > 0, var_c.clamp_min(0), torch.zeros_like(var_c)).sqrt()  # padded rows: 0, not 0/0


def _output(c: torch.Tensor, se: torch.Tensor | None) -> MethodOutput:
    return MethodOutput(c, {} if se is None else {"stderr": se})


@register(
    "hta",
    dims=LTS,
    extra_passes=True,
    options=OPTIONS,
    extras={"stderr": LTS},
    explains=True,
    slow=True,
    card=Card(
        definition="HTA_ij = ‖∂e^l_i/∂x_j‖_F, rows normalised (Brunner et al. 2020), by forward-mode Jacobian-vector "
        "products; mode estimate: Hutchinson probes, with standard errors.",
        passes="exact: n·d_in JVPs (each about one forward); estimate: n·probes JVPs.",
        memory="[L, n, n]; no row mode.",
        note="checked against mixlens' own reverse-mode loop instead: relative 9.8e-7 on ‖J‖²_F "
        "(benchmarks/bench_hta.py)",
        background=BACKGROUND,
    ),
)
def hta(trace: Trace, *, input: str = "word", mode: str = "exact", probes: int = 16, seed: int = 0) -> MethodOutput:
    """Hidden token attribution ‖∂e^l_i/∂x_j‖_F, rows normalised (Brunner 2020); forward-mode JVPs."""
    jn = jacobian_norms(trace, input=input, mode=mode, probes=probes, seed=seed)
    return _output(*shares(jn.hidden, jn.hidden_se))  # [B, L, target, source]; stderr in estimate mode


@register(
    "head_attribution",
    dims=LHTS,
    extra_passes=True,
    options=OPTIONS,
    extras={"stderr": LHTS},
    card=Card(
        definition="A^{l,h}_ij = ‖∂o^{l,h}_i/∂x_j‖_F, rows normalised (Pascual et al. 2021), by forward-mode JVPs.",
        passes="exact: n·d_in JVPs (each about one forward); estimate: n·probes JVPs.",
        memory="[L, H, n, n]; no row mode.",
        background=BACKGROUND,
    ),
)
def head_attribution(
    trace: Trace, *, input: str = "word", mode: str = "exact", probes: int = 16, seed: int = 0
) -> MethodOutput:
    """Per-head global attribution ‖∂o^{l,h}_i/∂x_j‖_F, rows normalised (Pascual 2021)."""
    jn = jacobian_norms(trace, input=input, mode=mode, probes=probes, seed=seed)
    return _output(*shares(jn.heads, jn.heads_se))  # [B, L, H, target, source]; stderr in estimate mode
