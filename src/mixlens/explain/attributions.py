"""One score per source token for a target (`mixlens.targets`), for every method that explains one.

Every method comes from the registry (`Method.explains`, `Method.reads(kind)`):

- methods with axes ('source',) take the target as their options `target` / `foil` (the gradient family, captum's
  perturbation methods, `decompx_logit`); explain runs each with the options it declares for explain
  (`Method.explain_options`: the signed form where a method has one);
- `decompx_classes` ('class', 'source'): the target class row, minus the foil row for a contrast;
- maps [layer, target, source]: the target row of their last layer — [CLS] for classifier encoders, the mean of
  the rows for mean-pooled encoders, the target position of language models.

All outputs are [B, n] with padding 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from mixlens.errors import MixlensError
from mixlens.methods import get, registry
from mixlens.pipeline import run_methods
from mixlens.targets import Readout
from mixlens.targets import Request as Resolved
from mixlens.trace import Trace

Request = int | str | tuple[int, ...] | Resolved  # 'pred', a class / token id, (Python) one id per input, or resolved
Foil = int | tuple[int, ...] | None
REFERENCE_METHOD, _REFERENCE = registry.reference()  # the method that declares the agreement reference
REFERENCE = _REFERENCE.label  # its label among the scores (grad_x_input_l2: ‖∂g/∂e_j ⊙ e_j‖₂)


def applicable(kind: str) -> list[str]:
    """Every method that explains a target of this model kind."""
    return registry.explainers(kind)


def default_methods(kind: str, family: Any = None) -> list[str]:
    """The default set: every applicable method that is not slow and (given the model's family) supports it."""
    return [m for m in registry.explainers(kind, defaults=True) if family is None or get(m).refusal(family) is None]


def check_methods(kind: str, methods: list[str], family: Any = None) -> list[str]:
    """`methods` (registry names), each one that explains this kind of target and supports the family."""
    ok = applicable(kind)
    for m in methods:
        spec = get(m)  # unknown names: one line listing the registry
        if m not in ok:
            what = {"classifier": "a classifier's", "causal": "a causal LM's", "masked": "a masked LM's"}.get(
                kind, "an encoder's"
            )
            runs = [v for v in ok if family is None or get(v).refusal(family) is None]  # those the family runs
            raise MixlensError(f"method '{m}' does not explain {what} prediction; valid: {', '.join(runs)}")
        why = None if family is None else spec.refusal(family)
        if why is not None:
            raise MixlensError(why)
    return list(dict.fromkeys(methods))


def _row(values: torch.Tensor, mask: torch.Tensor, ro: Readout) -> torch.Tensor:
    """values [B, layer, target, source] → the target row of the last layer [B, source]."""
    last = values[:, -1]
    if ro.kind == "encoder" and ro.pool == "mean":
        m = mask.to(last.dtype)
        return (last * m[:, :, None]).sum(1) / m.sum(1, keepdim=True)
    pos = ro.position if ro.kind in ("causal", "masked") else torch.zeros(mask.shape[0], dtype=torch.long)
    return last[torch.arange(last.shape[0]), pos.to(last.device)]


def _explained_row(spec: Any, ro: Readout, trace: Trace) -> list[int] | None:
    """The one target row an LM's map method (declaring `row_mode`) needs, as `run_methods` rows: the same
    position, or the same distance from the end, in every input ([p] or [p − n]); None otherwise (every row: the
    [layer, n, n] maps). A causal LM's last token is [−1], so its maps are [layer, 1, n], not [layer, n, n]."""
    if not spec.row_mode or spec.dims in (("source",), ("class", "source")) or ro.kind not in ("causal", "masked"):
        return None
    pos = ro.position.cpu()
    from_end = pos - torch.tensor(trace.lengths)
    for same in (pos, from_end):
        if bool((same == same[0]).all()):
            return [int(same[0])]
    return None


def options_for(name: str, target: Request, foil: Foil, seed: int) -> dict[str, object]:
    """The options `explain` runs method `name` with: the request (`target`, `foil`) where the method takes one,
    the seed, and the method's explain options (`Method.explain_options`)."""
    spec = get(name)
    keys = {o.name for o in spec.options}
    opts: dict[str, object] = {}
    if "target" in keys:
        opts["target"] = target
    if "foil" in keys and foil is not None:
        opts["foil"] = foil
    if "seed" in keys:
        opts["seed"] = seed
    return {**opts, **spec.explain_options}


def attribute(
    trace: Trace,
    ro: Readout,
    methods: list[str],
    *,
    target: Request = "pred",
    foil: Foil = None,
    seed: int = 0,
    reference: bool = False,
    timings: dict[str, float] | None = None,
    on_method: Callable[[str], None] | None = None,
    extras: dict[str, dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Scores [B, n] (padding 0) of each method for the batch of `trace` and its targets `ro` (`target` / `foil`:
    the request `ro` was resolved from, passed on to the methods that take it); with `reference` also
    `REFERENCE`. `timings` accumulates seconds per method; `on_method(name)` is called as each one finishes (for
    progress); `extras`, when given, receives each method's secondary outputs (name → [B, *axes], on the CPU)."""
    mask = trace.mask
    fmask = mask.to(torch.float32).cpu()
    timings = timings if timings is not None else {}
    resolved = ro.request()  # the request as resolved for this batch: methods read it, resolving nothing again
    if resolved is not None:
        target, foil = resolved, None
    out: dict[str, torch.Tensor] = {}
    one_row = {name: _explained_row(get(name), ro, trace) for name in methods}
    # the methods on every row first, then the reference, then those on the explained row only: a trace's memo
    # (shared gradients, norm passes) is kept while the rows stay the same
    order = [m for m in methods if one_row[m] is None] + [REFERENCE] * reference + [m for m in methods if one_row[m]]
    for name in order:
        if name == REFERENCE:
            ref: dict[str, object] = {"target": target, **_REFERENCE.options}
            if foil is not None:
                ref["foil"] = foil
            step = run_methods(trace, [REFERENCE_METHOD], options={REFERENCE_METHOD: ref})
            out[REFERENCE] = step.values[REFERENCE_METHOD].cpu() * fmask
            if on_method:
                on_method(REFERENCE)
            continue
        spec = get(name)
        t0 = time.perf_counter()
        step = run_methods(trace, [name], options={name: options_for(name, target, foil, seed)}, rows=one_row[name])
        v = step.values[name].float()
        if extras is not None:
            extras[name] = {k: x.detach().cpu() for k, x in step.extras.get(name, {}).items()}
        if spec.dims == ("class", "source"):
            rows = torch.arange(v.shape[0], device=v.device)
            v = v[rows, ro.index.to(v.device)] - torch.where(
                ro.foil.to(v.device)[:, None] >= 0, v[rows, ro.foil.clamp_min(0).to(v.device)], 0.0
            )
        elif one_row[name] is not None:
            v = v[:, -1, 0]  # [B, layer, 1, source]: the last layer's explained row
        elif spec.dims != ("source",):
            v = _row(v, mask, ro)
        out[name] = v.detach().cpu() * fmask
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
        if on_method:
            on_method(name)
    return {k: out[k] for k in [*methods, *[REFERENCE] * reference]}  # in the order asked
