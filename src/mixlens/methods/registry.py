"""Method registry: name → one pure function `fn(trace, *, heads=False, **options) -> Tensor`.

The returned tensor has the axes `[batch, *dims]` (or `[batch, *head_dims]` with `heads=True`) in the
fixed order `[batch, layer, head, target, source]`; padded positions hold 0. The CLI, reports and the
corpus runner only talk to this registry.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mixlens.errors import MixlensError
from mixlens.trace import Trace

MethodFn = Callable[..., torch.Tensor]
LTS = ("layer", "target", "source")
LHTS = ("layer", "head", "target", "source")


@dataclass(frozen=True)
class Method:
    name: str
    fn: MethodFn
    dims: tuple[str, ...]  # axes after batch
    head_dims: tuple[str, ...] | None  # axes with heads=True (None: no per-head variant)
    needs_ffn: bool  # needs FFN activations in the trace
    extra_passes: bool  # runs the model again (value zeroing, gradients, ablations)
    summary: str

    @property
    def needs_output(self) -> bool:
        """Needs the whole forward pass (last FFN, logits); otherwise a trace may stop after the last attention
        block."""
        return self.needs_ffn or self.extra_passes

    def options(self) -> dict[str, object]:
        """Keyword options the function takes besides `trace` and `heads`, with their defaults."""
        sig = inspect.signature(self.fn)
        return {k: p.default for k, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY and k != "heads"}

    def __call__(self, trace: Trace, heads: bool = False, **options: object) -> torch.Tensor:
        fam = trace.adapter.family
        if self.name in fam.refuses:
            raise MixlensError(f"method '{self.name}' does not support the {fam.name} family: {fam.why}")
        unknown = set(options) - set(self.options())
        if unknown:
            raise MixlensError(f"method '{self.name}' has no option {sorted(unknown)}; options: "
                               f"{sorted(self.options()) or 'none'}")
        if heads and self.head_dims is None:
            return self.fn(trace, **options)
        return self.fn(trace, heads=heads, **options) if self.head_dims else self.fn(trace, **options)

    def dims_for(self, heads: bool) -> tuple[str, ...]:
        return self.head_dims if heads and self.head_dims else self.dims


REGISTRY: dict[str, Method] = {}


def register(
    name: str,
    *,
    dims: tuple[str, ...] = LTS,
    head_dims: tuple[str, ...] | None = None,
    needs_ffn: bool = False,
    extra_passes: bool = False,
) -> Callable[[MethodFn], MethodFn]:
    def deco(fn: MethodFn) -> MethodFn:
        if name in REGISTRY:
            raise RuntimeError(f"method '{name}' registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        REGISTRY[name] = Method(name, fn, dims, head_dims, needs_ffn, extra_passes, summary)
        return fn

    return deco


def get(name: str) -> Method:
    try:
        return REGISTRY[name]
    except KeyError:
        raise MixlensError(f"unknown method '{name}'; valid methods: {', '.join(names())}") from None


def names() -> list[str]:
    return list(REGISTRY)
