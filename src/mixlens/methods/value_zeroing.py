"""Value zeroing (Mohebbi et al. 2023; docs/DESIGN.md §3.5): re-run one layer with the value vector of token j zeroed.

For layer l and source j, the layer module is called again on its captured input x (so FFN, both norms and the
residuals act exactly as in the model) with v_j = 0 in every (key/value) head. α does not depend on the values,
so it is the original one. C_ij = cosine distance between the new and the real output of token i, rows
normalised to 1; global = rollout. The n zeroed copies of a batch are stacked along the batch axis and run in as
few calls as the memory bound allows. Causal models need no special case: zeroing v_j cannot reach i < j.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixlens.methods.registry import register
from mixlens.methods.rollout import pair_mask, rollout, row_normalize
from mixlens.trace import Trace, hooked

MAX_TOKENS_PER_CALL = 1 << 13  # examples·copies·n tokens in one layer call (activations stay near cache)


def _layer_calls(trace: Trace) -> list[tuple[tuple, dict[str, Any]]]:
    """(args, kwargs) each layer module was called with, recorded in one plain forward pass (cached)."""
    if "layer_calls" not in trace.cache:
        calls: list[tuple[tuple, dict[str, Any]]] = []
        modules = list({id(lay.module): lay.module for lay in trace.adapter.layers}.values())  # ALBERT shares

        def pre(_m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            calls.append((args, dict(kwargs)))

        handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in modules]
        try:
            with torch.no_grad():
                trace.model(**trace.inputs)
        finally:
            for h in handles:
                h.remove()
        if len(calls) != trace.adapter.n_layers:
            raise RuntimeError(f"layer modules were called {len(calls)} times for {trace.adapter.n_layers} layers")
        trace.cache["layer_calls"] = calls
    return trace.cache["layer_calls"]


def _expand(obj: Any, batch: int, rows: torch.Tensor, copies: int) -> Any:
    """Keep the examples `rows` of every per-example tensor (leading axis = batch) and repeat each `copies`
    times, example-major; caches are dropped."""
    if isinstance(obj, torch.Tensor):
        return obj[rows].repeat_interleave(copies, dim=0) if obj.dim() and obj.shape[0] == batch else obj
    if isinstance(obj, tuple):
        return tuple(_expand(o, batch, rows, copies) for o in obj)
    if type(obj).__name__.endswith("Cache"):
        return None
    return obj


def _zeroed_outputs(trace: Trace, index: int, rows: torch.Tensor, sources: range) -> torch.Tensor:
    """Output of layer `index` for the examples `rows` with v_j = 0, for each j in `sources`:
    [len(rows), len(sources), n, d]."""
    args, kwargs = _layer_calls(trace)[index]
    x = trace.layers[index].x
    b, n, d = x.shape
    m = len(sources)
    keep = torch.ones(m, n, dtype=x.dtype, device=x.device)
    keep[torch.arange(m), torch.arange(sources.start, sources.stop)] = 0
    keep = keep.repeat(len(rows), 1)[:, None, :, None]  # [R·m, 1, n, 1], example-major like _expand

    args = tuple(_expand(a, b, rows, m) for a in (x, *args[1:]))
    kwargs = {k: _expand(v, b, rows, m) for k, v in kwargs.items() if k != "hidden_states"}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    # a direct call of one layer module makes exactly one attention call, named blocks.0 by the engine
    with hooked(trace.adapter, {"blocks.0.attn.v": lambda v: v * keep}):
        out = trace.adapter.layers[index].module(*args, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(len(rows), m, n, d)


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1 − cos(a, b) over the last axis as ½‖â − b̂‖², in float64: no cancellation when a ≈ b."""
    a, b = a.double(), b.double()
    eps = torch.finfo(torch.float64).tiny
    diff = a / a.norm(dim=-1, keepdim=True).clamp_min(eps) - b / b.norm(dim=-1, keepdim=True).clamp_min(eps)
    return (0.5 * diff.pow(2).sum(-1)).float()


def _layer(trace: Trace, index: int) -> torch.Tensor:
    """C [B, n(target), n(source)]: cosine distance of each token's output when source j's value is zeroed.
    Sources that are padding of an example are skipped for that example."""
    real = trace.layers[index].out  # [B, n, d]
    assert real is not None  # a full trace
    b, n, _ = real.shape
    lengths = torch.tensor(trace.lengths)
    out = torch.zeros(b, n, n)
    s = 0
    while s < n:
        rows = torch.nonzero(lengths > s).flatten()  # examples for which source s is a real token
        step = max(1, MAX_TOKENS_PER_CALL // (len(rows) * n))
        src = range(s, min(n, s + step))
        zeroed = _zeroed_outputs(trace, index, rows, src)  # [R, m, n(target), d]
        out[rows, :, s : src.stop] = cosine_distance(zeroed, real[rows, None]).transpose(1, 2)
        s = src.stop
    return out


def value_zeroing_matrices(trace: Trace) -> torch.Tensor:
    """Per-layer value-zeroing matrices, rows normalised: [B, L, n, n] (cached on the trace)."""
    if "value_zeroing" not in trace.cache:
        with torch.no_grad():
            mats = torch.stack([_layer(trace, i) for i in range(trace.adapter.n_layers)], dim=1)
        trace.cache["value_zeroing"] = row_normalize(mats.clamp_min(0) * pair_mask(trace.mask))
    return trace.cache["value_zeroing"]


@register("value_zeroing", extra_passes=True)
def value_zeroing(trace: Trace) -> torch.Tensor:
    """Value zeroing (Mohebbi 2023): cosine distance of layer outputs when value j is zeroed, rows normalised."""
    return value_zeroing_matrices(trace)


@register("value_zeroing_rollout", extra_passes=True)
def value_zeroing_rollout(trace: Trace) -> torch.Tensor:
    """Value-zeroing global attribution: rollout of the per-layer matrices over layers 1..l."""
    return rollout(value_zeroing_matrices(trace))
