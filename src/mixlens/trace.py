"""Capture of one forward pass: hook points with obvious names → `Trace`.

The attention probabilities and value vectors are taken inside the model's own eager attention
function (we wrap it, never copy it), everything else by forward hooks on the modules the adapter names.
Hook points for interventions (TransformerLens-style names), each `fn(tensor) -> tensor`:

- `blocks.{l}.attn.v`        value vectors   [batch, kv_head, source, d_head]
- `blocks.{l}.attn.pattern`  attention α     [batch, head, target, source]
- `blocks.{l}.attn.z`        head contexts   [batch, head, target, d_head]  (before the output projection)
"""

from __future__ import annotations

import contextvars
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mixlens.adapters import Adapter, _get

Edit = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LayerTrace:
    """What one layer saw and produced. Shapes use B=batch, n=tokens, d=hidden, H heads."""

    x: torch.Tensor  # [B, n, d] residual stream entering the layer
    alpha: torch.Tensor  # [B, H, n(target), n(source)]
    value: torch.Tensor  # [B, H_kv, n, d_head] value vectors (bias included; pre-LN: of LN(x))
    attn_out: torch.Tensor  # [B, n, d] real attention output (output projection, b_O included)
    mix_in: torch.Tensor  # [B, n, d] real input of ln_mix: x + attention output
    mix_out: torch.Tensor  # [B, n, d] real output of ln_mix
    out: torch.Tensor | None  # [B, n, d] layer output (None for the last layer of a partial trace)
    ffn_pre: torch.Tensor | None = None  # [B, n, d_ff] FFN pre-activation (ffn_in output)
    ffn_act: torch.Tensor | None = None  # [B, n, d_ff] FFN activation (ffn_out input)
    ln_out_in: torch.Tensor | None = None  # [B, n, d] post-LN: input of LN2
    ffn_gate: torch.Tensor | None = None  # [B, n, d_ff] gated FFN: gate projection output
    post_scale: torch.Tensor | None = None  # [B, n] sandwich norm (Gemma): s^post_i of the output projection's output

    @property
    def alpha_mix(self) -> torch.Tensor:
        """α as the norm decomposition mixes it: α^h_ij / s^post_i with a sandwich norm (γ_post is in W_O), else α.
        [B, H, n(target), n(source)]."""
        return self.alpha if self.post_scale is None else self.alpha / self.post_scale[:, None, :, None]


@dataclass
class Trace:
    """One forward pass over a padded batch (right padding; `mask` marks real tokens)."""

    adapter: Adapter
    model: nn.Module
    inputs: dict[str, torch.Tensor]  # what the model was called with (input_ids, attention_mask, ...)
    layers: list[LayerTrace]
    logits: torch.Tensor | None  # model head output when the model has one (None for a partial trace)
    tokenizer: object | None = None  # for special-token roles (e.g. the [MASK] position of saliency)
    cache: dict[str, object] = field(default_factory=dict)  # shared intermediate results of methods

    @property
    def mask(self) -> torch.Tensor:  # [B, n] bool
        return self.inputs["attention_mask"].bool()

    @property
    def lengths(self) -> list[int]:
        return self.mask.sum(-1).tolist()


class _Session:
    def __init__(self, edits: dict[str, Edit]):
        self.edits = edits
        self.calls = 0
        self.alpha: list[torch.Tensor] = []
        self.value: list[torch.Tensor] = []

    def edit(self, name: str, t: torch.Tensor) -> torch.Tensor:
        fn = self.edits.get(name)
        return t if fn is None else fn(t)


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("mixlens_session", default=None)


def _repeat_kv(v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, H_kv, n, d_h] → [B, H, n, d_h] (grouped-query attention shares value heads)."""
    rep = n_heads // v.shape[1]
    return v if rep == 1 else v.repeat_interleave(rep, dim=1)


def _attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """Wraps the family's own `eager_attention_forward`; records α and v and applies edits."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    s = _SESSION.get()
    if s is None:
        return eager(module, query, key, value, attention_mask, **kwargs)
    layer = s.calls
    s.calls += 1
    value = s.edit(f"blocks.{layer}.attn.v", value)
    out, alpha = eager(module, query, key, value, attention_mask, **kwargs)
    p_name, z_name = f"blocks.{layer}.attn.pattern", f"blocks.{layer}.attn.z"
    if p_name in s.edits or z_name in s.edits:
        alpha = s.edit(p_name, alpha)
        z = torch.matmul(alpha, _repeat_kv(value, alpha.shape[1]))  # [B, H, n, d_h]
        out = s.edit(z_name, z).transpose(1, 2).contiguous()
    s.alpha.append(alpha)
    s.value.append(value)
    return out, alpha


@contextmanager
def _eager_wrapped() -> Iterator[None]:
    prev = ALL_ATTENTION_FUNCTIONS._local_mapping.get("eager")
    ALL_ATTENTION_FUNCTIONS["eager"] = _attention
    try:
        yield
    finally:
        if prev is None:
            del ALL_ATTENTION_FUNCTIONS["eager"]
        else:
            ALL_ATTENTION_FUNCTIONS["eager"] = prev


def _module_route(adapter: Adapter, s: _Session) -> list:
    """Capture and edits for attention that does not go through ALL_ATTENTION_FUNCTIONS (MPNet): v from the value
    projection's output, α from the output of the module `family.probs` (the attention dropout, identity in eval), z
    from the output projection's input. Calls are named in order like the eager route. Returns the hook handles."""
    fam, handles = adapter.family, []
    current = [0]

    def value(m: nn.Module, a: tuple, o: torch.Tensor, h: int) -> torch.Tensor:
        current[0] = s.calls
        s.calls += 1
        v = s.edit(f"blocks.{current[0]}.attn.v", o.unflatten(-1, (h, -1)).transpose(1, 2))  # [B, H, n, d_h]
        s.value.append(v)
        return v.transpose(1, 2).flatten(2)

    def pattern(m: nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor:
        alpha = s.edit(f"blocks.{current[0]}.attn.pattern", o)
        s.alpha.append(alpha)
        return alpha

    def z(m: nn.Module, a: tuple, d_h: int) -> tuple:
        ctx = a[0].unflatten(-1, (-1, d_h)).transpose(1, 2)  # [B, H, n, d_h]
        return (s.edit(f"blocks.{current[0]}.attn.z", ctx).transpose(1, 2).flatten(2), *a[1:])

    for lay in adapter.layers:
        handles.append(_get(lay.module, fam.v_proj).register_forward_hook(
            lambda m, a, o, h=lay.n_heads: value(m, a, o, h)))
        handles.append(_get(lay.module, fam.probs).register_forward_hook(pattern))
        if any(k.endswith(".attn.z") for k in s.edits):
            handles.append(lay.o_proj.register_forward_pre_hook(lambda m, a, d_h=lay.d_head: z(m, a, d_h)))
    return handles


def _first(out):
    return out[0] if isinstance(out, tuple) else out


class _Stop(Exception):
    """Raised by the hook that ends a partial forward pass after the last layer's ln_mix."""


@contextmanager
def hooked(adapter: Adapter, edits: dict[str, Edit] | None = None, ffn: bool = False,
           stop: bool = False) -> Iterator[dict]:
    """Install capture hooks (and attention edits) for one forward call; yields the raw record. With `stop`,
    the forward pass ends (raising `_Stop`) once the last layer's ln_mix has run."""
    rec: dict[str, list[torch.Tensor]] = defaultdict(list)
    handles = []
    seen: set[tuple[int, str]] = set()

    def add(mod: nn.Module | None, name: str, kind: str) -> None:
        if mod is None or (id(mod), name) in seen:  # ALBERT: shared modules fire once per use
            return
        seen.add((id(mod), name))
        if kind == "pre":
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, k: rec[name].append(a[0] if a else k["hidden_states"]), with_kwargs=True))
        elif kind == "in":
            handles.append(mod.register_forward_hook(lambda m, a, o: rec[name].append(a[0])))
        elif kind == "out":
            handles.append(mod.register_forward_hook(lambda m, a, o: rec[name].append(_first(o))))
        else:  # both

            def both(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
                rec[name + "_in"].append(a[0])
                rec[name + "_out"].append(o)

            handles.append(mod.register_forward_hook(both))

    session = _Session(edits or {})
    if adapter.family.probs is not None:
        handles += _module_route(adapter, session)
    for lay in adapter.layers:
        add(lay.module, "x", "pre")
        add(lay.module, "out", "out")
        add(lay.o_proj, "attn_out", "out")
        add(lay.ln_mix.module, "mix", "both")
        add(lay.proj, "post_raw", "out")
        if ffn:
            add(lay.ffn_in, "ffn_pre", "out")
            add(lay.ffn_out, "ffn_act", "in")
            add(lay.ln_out.module if lay.ln_out else None, "ln_out_in", "in")
            add(lay.ffn_gate, "ffn_gate", "out")
    if stop:
        def halt(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
            if len(rec["mix_out"]) == adapter.n_layers:  # ALBERT's shared norm fires once per layer
                raise _Stop

        handles.append(adapter.layers[-1].ln_mix.module.register_forward_hook(halt))
    token = _SESSION.set(session)
    try:
        with _eager_wrapped():
            yield rec
    finally:
        _SESSION.reset(token)
        for h in handles:
            h.remove()
        rec["alpha"], rec["value"] = session.alpha, session.value


def run_traced(
    adapter: Adapter,
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    edits: dict[str, Edit] | None = None,
    ffn: bool = False,
    tokenizer: object | None = None,
    full: bool = True,
) -> Trace:
    """One forward pass with capture hooks → Trace (call under torch.no_grad() for analysis). `full=False`
    stops after the last layer's ln_mix: everything the attention-block methods use, without the last FFN and
    the model head (the last layer's `out` and the logits are then None)."""
    output = None
    try:
        with hooked(adapter, edits, ffn and full, stop=not full) as rec:
            output = model(**inputs)
    except _Stop:
        rec["out"].append(None)
    n = adapter.n_layers
    for key in ("x", "out", "attn_out", "mix_in", "mix_out", "alpha", "value"):
        if len(rec[key]) != n:
            raise RuntimeError(f"capture of '{key}' fired {len(rec[key])} times for {n} layers")
    opt = {k: rec[k] if len(rec.get(k, [])) == n else [None] * n for k in ("ffn_pre", "ffn_act", "ln_out_in",
                                                                             "ffn_gate", "post_raw")}
    post = [None if raw is None else lay.ln_post.scale(raw.float()) for raw, lay in zip(opt["post_raw"],
                                                                                       adapter.layers, strict=True)]
    layers = [
        LayerTrace(x=rec["x"][i], alpha=rec["alpha"][i], value=rec["value"][i], attn_out=rec["attn_out"][i],
                   mix_in=rec["mix_in"][i],
                   mix_out=rec["mix_out"][i], out=rec["out"][i], ffn_pre=opt["ffn_pre"][i],
                   ffn_act=opt["ffn_act"][i], ln_out_in=opt["ln_out_in"][i], ffn_gate=opt["ffn_gate"][i],
                   post_scale=post[i])
        for i in range(n)
    ]
    logits = getattr(output, "logits", None)
    return Trace(adapter=adapter, model=model, inputs=inputs, layers=layers, logits=logits, tokenizer=tokenizer)
