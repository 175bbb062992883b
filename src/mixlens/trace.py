"""Capture of one forward pass, and the named edit points: the one place where mixlens touches a model.

The attention probabilities and value vectors are taken inside the model's own eager attention function (we
wrap it, never copy it), everything else by forward hooks on the modules the adapter names. A pre-hook on every
layer module tells all other hooks the real index l of the layer that runs (ALBERT calls one shared module for
several layers: each call takes the next of that module's indices), so edit points are named by layer, never by
call order. Threads may trace different models at once; one model's traces take turns (its
hooks see every call of its modules).

Edit points (TransformerLens-style names), each `fn(tensor) -> tensor` of the same shape:

- `embed`                    word-piece embeddings [batch, n, d_emb]: the input-embedding module's output for the
                             token ids, before position embeddings and LayerNorm (d_emb ≠ d for ALBERT, ELECTRA)
- `blocks.{l}.resid_pre`     residual stream entering layer l  [batch, n, d]
- `blocks.{l}.attn.v`        value vectors   [batch, kv_head, source, d_head]
- `blocks.{l}.attn.pattern`  attention α     [batch, head, target, source]
- `blocks.{l}.attn.z`        head contexts   [batch, head, target, d_head]  (before the output projection)

`hooked(..., start=l, resid_pre=x)` feeds x into layer l and runs layers ≥ l only (the modules of earlier layers
return their input without computing; the embeddings are still computed, then replaced); `stop_after=l` ends the
forward pass after layer l's output, `stop_at_mix=True` right after its ln_mix (its attention block).

Inside `recomputed_layers()`, a gradient pass (`hooked` under grad mode) keeps only each layer's input for its
backward and runs the layer again during the backward (activation checkpointing), with the same session, edits and
forward hooks live: the memory of a long input's backward is one layer's activations plus L · n · d, not L layers'.
"""

from __future__ import annotations

import contextvars
import inspect
import re
import sys
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mixlens import inplace
from mixlens.adapters import Adapter, Layer, get_path
from mixlens.errors import MixlensError
from mixlens.memory import LONG_TOKENS, attention_bytes, check_fits, release
from mixlens.rowattn import LazyMask, QKRows, attend, dense_mask, mask_interface

Edit = Callable[[torch.Tensor], torch.Tensor]
LayerSink = Callable[[int, "LayerTrace"], None]  # (layer index, that layer's complete record) → None
BLOCK_POINTS = ("resid_pre", "attn.v", "attn.pattern", "attn.z")

_POINT = re.compile(r"blocks\.(\d+)\.(" + "|".join(re.escape(p) for p in BLOCK_POINTS) + ")")


FfnCapture = bool | Literal["update"]
"""What a trace captures of the FFN: True its activations (`ffn_pre`, `ffn_act`, `ln_out_in`, `ffn_gate`: [n, d_ff]
per layer), "update" only its last projection's output (`ffn_update`, [n, d] per layer), False nothing."""


@dataclass
class LayerTrace:
    """What one layer saw and produced. Shapes use B=batch, n=tokens, d=hidden, H heads. In a trace whose layers a
    sink consumed during the forward pass (`run_traced(sink=)`), every tensor field but `post_scale` is empty ([0])."""

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
    ffn_update: torch.Tensor | None = None  # [B, n, d] the FFN's last projection's output (`ffn="update"`)
    post_scale: torch.Tensor | None = None  # [B, n] sandwich norm (Gemma): s^post_i of the output projection's output
    qk: QKRows | None = None  # row mode (`hooked(qk_rows=True)`): α is empty [0]; its rows come from q and K

    @property
    def alpha_mix(self) -> torch.Tensor:
        """α as the norm decomposition mixes it: α^h_ij / s^post_i with a sandwich norm (γ_post is in W_O), else α.
        [B, H, n(target), n(source)]."""
        return self.alpha if self.post_scale is None else self.alpha / self.post_scale[:, None, :, None]

    def alpha_rows(self, rows: torch.Tensor, mix: bool = False, b: int | None = None) -> torch.Tensor:
        """α at target positions rows [B, K]: [B, H, K, n] float32, from α or (row mode) from q and K; `mix`: divided
        by s^post_i as `alpha_mix`. `b`: of input b alone, rows [K] → [H, K, n]."""
        if b is not None:
            one = slice(b, b + 1)
            post = None if self.post_scale is None else self.post_scale[one]
            qk = None if self.qk is None else self.qk.of_input(b)
            e = self._empty(4)
            alone = LayerTrace(e[0], self.alpha[one], e[1], e[2], e[3], e[0], None, post_scale=post, qk=qk)
            return alone.alpha_rows(rows[None], mix)[0]
        if self.qk is not None:
            a = self.qk.rows(rows)
        else:
            bsz, h, _, n = self.alpha.shape
            a = self.alpha.float().gather(2, rows[:, None, :, None].expand(bsz, h, rows.shape[1], n))
        if mix and self.post_scale is not None:
            a = a / self.post_scale.gather(1, rows)[:, None, :, None]
        return a

    def _empty(self, k: int) -> list[torch.Tensor]:
        return [self.x.new_empty(0) for _ in range(k)]

    def for_rows(self, alti: bool = False) -> LayerTrace:
        """What rebuilding α's rows needs of this row-mode layer, kept after the forward pass: q, K and the
        normaliser (`qk`) and the sandwich scale; with `alti` also v and the residual sum (ALTI's row function, which
        gets its self pairs, the only place x enters, computed while the layer ran). Every other tensor is empty."""
        v, mix_in = (self.value, self.mix_in) if alti else self._empty(2)
        e = self._empty(4)
        return LayerTrace(e[3], e[0], v, e[1], mix_in, e[2], None, post_scale=self.post_scale, qk=self.qk)

    def alpha_diagonal(self, mix: bool = False) -> torch.Tensor:
        """α^h_ii: [B, H, n] float32 (`mix`: divided by s^post_i)."""
        a = self.qk.diagonal() if self.qk is not None else self.alpha.float().diagonal(dim1=2, dim2=3)
        return a / self.post_scale[:, None, :] if mix and self.post_scale is not None else a


@dataclass
class Trace:
    """One forward pass over a padded batch (right padding; `mask` marks real tokens)."""

    adapter: Adapter
    model: Any  # the transformers model (dynamic attributes: config, heads)
    inputs: dict[str, torch.Tensor]  # what the model was called with (input_ids, attention_mask, ...)
    layers: list[LayerTrace]
    logits: torch.Tensor | None  # model head output when the model has one (None for a partial trace)
    tokenizer: object | None = None  # for special-token roles (e.g. the [MASK] position of saliency)
    memo: Any = None  # the methods' shared results on this trace (`mixlens.methods.memo.Memo`, made on first use)
    hidden: torch.Tensor | None = None  # [B, n, d] a base model's own output (`last_hidden_state`), when it ran
    logit_at: torch.Tensor | None = None  # [K] sorted positions whose logits `logits` [B, K, V] holds (None: all)

    def logit_rows(self, positions: torch.Tensor, b: int | None = None) -> torch.Tensor:
        """The logits at each input's position, positions [B] → [B, V]; with `b`, at input b's positions [K] →
        [K, V] (the model's own, as computed), whether the trace kept every position's logits or only some
        (`logit_at`)."""
        assert self.logits is not None
        pos = positions.to(self.logits.device)
        if self.logit_at is not None:
            at = self.logit_at.to(pos.device)
            k = torch.searchsorted(at, pos).clamp_max(len(at) - 1)
            if not bool((at[k] == pos).all()):
                raise ValueError(f"this trace kept the logits at positions {at.tolist()} only")
            pos = k
        if b is not None:
            return self.logits[b, pos]
        return self.logits[torch.arange(pos.shape[0], device=pos.device), pos]

    @property
    def mask(self) -> torch.Tensor:  # [B, n] bool
        return self.inputs["attention_mask"].bool()

    @property
    def lengths(self) -> list[int]:
        return self.mask.sum(-1).tolist()


class _Stop(Exception):
    """Ends a forward pass early (`stop_after`, `stop_at_mix`); the `hooked` context that raised it swallows it."""

    def __init__(self, session: _Session):
        super().__init__("forward pass stopped")
        self.session = session


class _Session:
    """One hooked forward pass: the edits, the layers run (start..stop), the layer running now, the record."""

    def __init__(
        self,
        adapter: Adapter,
        edits: dict[str, Edit],
        start: int,
        stop: int,
        qk_rows: bool = False,
        fused: bool = False,
        record: bool = True,
    ):
        self.edits = edits
        self.record = record  # False: capture nothing (a gradient pass whose layers are recomputed in its backward)
        # attention rows from q and K (`mixlens.rowattn`): no [B, H, n, n] α; not where α takes a per-head bias (ALiBi)
        self.qk_rows = qk_rows and adapter.family.row_mode
        # attention through torch's fused kernels, nothing recorded: no [B, H, n, n] α kept (not MPNet's or BLOOM's
        # own route, nor where the family adds a per-head bias to the mask itself: ALiBi needs the dense mask)
        self.fused = fused and adapter.family.probs is None and adapter.family.row_mode
        self.inplace = adapter.family.inplace_attention
        self.causal = adapter.family.causal
        self.start, self.stop = start, stop
        self.layer = -1  # real index of the layer running now (-1: embeddings)
        self.embedded = False
        self.rec: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.indices: dict[int, list[int]] = defaultdict(list)  # id(layer module) → its layer indices, ascending
        for i, lay in enumerate(adapter.layers):
            self.indices[id(lay.module)].append(i)

    def enter(self, module: nn.Module) -> int:
        """The layer a call of `module` runs: the next of its indices after the layer that ran last."""
        later = [i for i in self.indices[id(module)] if i > self.layer]
        if not later:
            raise RuntimeError("a layer ran again after the last layer: one model call per hooked() context")
        self.layer = later[0]
        return self.layer

    @property
    def active(self) -> bool:
        """Whether the layer running now is one of the layers run."""
        return self.start <= self.layer <= self.stop

    def edit(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` after the edit of point `name`, if any, in `t`'s dtype (a bfloat16 / float16 model runs on in its
        own dtype when an edit computes in float32)."""
        fn = self.edits.get(name)
        if fn is None:
            return t
        out = fn(t)
        return out if out.dtype == t.dtype else out.to(t.dtype)


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("mixlens_session", default=None)
_DEFAULTS: contextvars.ContextVar[tuple[tuple[Adapter, dict[str, Edit]], ...]] = contextvars.ContextVar(
    "mixlens_default_edits", default=()
)


@contextmanager
def default_edits(adapter: Adapter, edits: Mapping[str, Edit]) -> Iterator[None]:
    """Within the context, every `hooked` call on `adapter` (so every trace, analysis and sweep of its lens) also
    applies `edits`, first (an explicit edit of the same point composes after it); points outside the layers a
    call runs are left out (a pass started at layer l is fed a stream the defaults already shaped)."""
    edits = dict(edits)
    _check(adapter, edits, 0, None, None)
    token = _DEFAULTS.set((*_DEFAULTS.get(), (adapter, edits)))
    try:
        yield
    finally:
        _DEFAULTS.reset(token)


def _with_defaults(adapter: Adapter, edits: dict[str, Edit], start: int, stop: int) -> dict[str, Edit]:
    """`edits` after the active default edits of `adapter` that fall in the layers start..stop."""
    out: dict[str, Edit] = {}
    for a, defaults in (*_DEFAULTS.get(), (adapter, edits)):
        if a is not adapter:
            continue
        for name, fn in defaults.items():
            m = _POINT.fullmatch(name)
            if (m is None and start > 0) or (m is not None and not start <= int(m[1]) <= stop):
                continue
            prev = out.get(name)
            out[name] = fn if prev is None else _then(prev, fn)
    return out


def _then(first: Edit, second: Edit) -> Edit:
    return lambda t: second(first(t))


def repeat_kv(v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, H_kv, n, d_h] → [B, H, n, d_h] (grouped-query attention shares value heads)."""
    rep = n_heads // v.shape[1]
    return v if rep == 1 else v.repeat_interleave(rep, dim=1)


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Wraps the family's own `eager_attention_forward` (or its in-place equal, `inplace.softmax_attention`); records
    α and v and applies the attention edits."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    s = _SESSION.get()
    if s is None:
        return eager(module, query, key, value, dense_mask(attention_mask), **kwargs)
    layer = s.layer
    value = s.edit(f"blocks.{layer}.attn.v", value)
    p_name, z_name = f"blocks.{layer}.attn.pattern", f"blocks.{layer}.attn.z"
    if s.fused and p_name not in s.edits and z_name not in s.edits and kwargs.get("softcap") is None:
        return _fused_attention(query, key, value, attention_mask, kwargs.get("scaling"), module.training, kwargs)
    if s.qk_rows and p_name not in s.edits and z_name not in s.edits and not module.training:
        scaling = kwargs.get("scaling")
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        out, qk = attend(query, key, value, attention_mask, scaling, kwargs.get("softcap"), s.causal)
        if s.record:
            s.rec["alpha"].append(qk)  # type: ignore[arg-type]  # `_layer_trace` makes it the LayerTrace's `qk`
            s.rec["value"].append(value)
        return out, None
    attention_mask = dense_mask(attention_mask)  # a row-mode pass's lazy mask, filled for this layer's eager code
    if s.inplace:
        eager = inplace.eager_for(eager, module, query, key, attention_mask, kwargs)
    out, alpha = eager(module, query, key, value, attention_mask, **kwargs)
    if p_name in s.edits or z_name in s.edits:
        alpha = s.edit(p_name, alpha)
        z = torch.matmul(alpha, repeat_kv(value, alpha.shape[1]))  # [B, H, n, d_h]
        out = s.edit(z_name, z).transpose(1, 2).contiguous()
    if s.record:
        s.rec["alpha"].append(alpha)
        s.rec["value"].append(value)
    return out, alpha


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Any,
    scaling: float | None,
    training: bool,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """softmax(q kᵀ · scaling + mask) v through `torch.nn.functional.scaled_dot_product_attention` (its flash /
    memory-efficient kernels: the forward keeps no [B, H, n, n] α and the backward recomputes it blockwise; the
    gradient is the attention's own, as eager autograd gives it). query [B, H, n, d_h], key and value
    [B, H_kv, n, d_h], mask additive [B, 1, n, n], a `rowattn.LazyMask` or None → ([B, n, H, d_h], None), the layout
    eager attention returns."""
    heads = query.shape[1]
    key, value = repeat_kv(key, heads), repeat_kv(value, heads)
    causal = isinstance(mask, LazyMask) and mask.causal_only
    dense = None if causal or mask is None else dense_mask(mask).to(query.dtype)
    if dense is not None and dense.shape[-1] != key.shape[-2]:
        dense = dense[..., : key.shape[-2]]  # as eager attention slices it
    p = float(kwargs.get("dropout", 0.0)) if training else 0.0
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=dense, dropout_p=p, is_causal=causal, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def _mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' eager mask, or in a row-mode or fused session a `rowattn.LazyMask` (no [B, 1, n, n] floats)."""
    s = _SESSION.get()
    if s is not None and (s.qk_rows or s.fused):
        return mask_interface(*args, **kwargs)
    return eager_mask(*args, **kwargs)


_WRAP_LOCK = threading.Lock()
_WRAPPED: list[Any] = [0, None, None]  # hooked() calls inside `_eager_wrapped` now (all threads), the entries replaced


@contextmanager
def _eager_wrapped() -> Iterator[None]:
    """`_attention` as transformers' "eager" attention and `_mask` as its eager mask while any thread traces
    (counted: a thread that ends its trace must not unwrap another's; both pass calls of threads without a session
    straight through)."""
    with _WRAP_LOCK:
        if _WRAPPED[0] == 0:
            _WRAPPED[1] = ALL_ATTENTION_FUNCTIONS._local_mapping.get("eager")
            _WRAPPED[2] = ALL_MASK_ATTENTION_FUNCTIONS._local_mapping.get("eager")
            ALL_ATTENTION_FUNCTIONS["eager"] = _attention
            ALL_MASK_ATTENTION_FUNCTIONS["eager"] = _mask
        _WRAPPED[0] += 1
    try:
        yield
    finally:
        with _WRAP_LOCK:
            _WRAPPED[0] -= 1
            if _WRAPPED[0] == 0:
                for registry, own in (
                    (ALL_ATTENTION_FUNCTIONS, _WRAPPED[1]),
                    (ALL_MASK_ATTENTION_FUNCTIONS, _WRAPPED[2]),
                ):
                    if own is None:
                        del registry["eager"]
                    else:
                        registry["eager"] = own


_MODEL_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()


def _model_lock(adapter: Adapter) -> threading.RLock:
    """One lock per model: its hooks see every call of its modules, so one thread traces it at a time."""
    with _WRAP_LOCK:
        return _MODEL_LOCKS.setdefault(adapter.base, threading.RLock())


ForwardHook = Callable[[nn.Module, tuple, Any], Any]
"""`hook(module, args, output)`, as `nn.Module.register_forward_hook`: a returned value replaces the output."""


@contextmanager
def scoped_hooks(adapter: Adapter, hooks: Iterable[tuple[nn.Module, ForwardHook]]) -> Iterator[None]:
    """Forward hooks on modules of the adapter's model for the passes run in the context (a method's own pass, e.g.
    AttnLRP's rules), all removed on exit, error or not. The model's lock is held meanwhile, as during a trace: one
    thread at a time sees this model's hooks (a trace inside the context, same thread, is allowed)."""
    lock = _model_lock(adapter)
    lock.acquire()
    handles: list[torch.utils.hooks.RemovableHandle] = []
    try:
        for module, hook in hooks:
            handles.append(module.register_forward_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()
        lock.release()


def _module_route(adapter: Adapter, s: _Session) -> list[torch.utils.hooks.RemovableHandle]:
    """Capture and edits for attention that does not go through ALL_ATTENTION_FUNCTIONS (MPNet): v from the value
    projection's output, α from the output of the module `family.probs` (the attention dropout, identity in eval),
    z from the output projection's input; all named by the layer running now. Returns the hook handles."""
    fam = adapter.family
    assert fam.probs is not None
    handles = []

    def value(o: torch.Tensor, h: int) -> torch.Tensor | None:
        if not s.active:
            return None
        v = s.edit(f"blocks.{s.layer}.attn.v", o.unflatten(-1, (h, -1)).transpose(1, 2))  # [B, H, n, d_h]
        if s.record:
            s.rec["value"].append(v)
        return v.transpose(1, 2).flatten(2)

    def fused(o: torch.Tensor, lay: Layer) -> torch.Tensor | None:
        """A fused qkv output laid out [H_kv, m, d_h] per token (`Family.qkv_groups`, BLOOM): v is the last of m."""
        if not s.active:
            return None
        groups = o.unflatten(-1, (lay.n_kv_heads, -1, lay.d_head))  # [B, n, H_kv, m, d_h]
        name = f"blocks.{s.layer}.attn.v"
        v = s.edit(name, groups[..., -1, :].transpose(1, 2))  # [B, H_kv, n, d_h]
        if s.record:
            s.rec["value"].append(v)
        if name not in s.edits:
            return None
        groups = groups.clone()
        groups[..., -1, :] = v.transpose(1, 2)
        return groups.flatten(-3)

    def pattern(m: nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor | None:
        if not s.active:
            return None
        alpha = s.edit(f"blocks.{s.layer}.attn.pattern", o)  # [B, H, n, n]
        if s.record:
            s.rec["alpha"].append(alpha)
        return alpha

    def z(a: tuple, d_h: int) -> tuple | None:
        if not s.active:
            return None
        ctx = a[0].unflatten(-1, (-1, d_h)).transpose(1, 2)  # [B, H, n, d_h]
        return (s.edit(f"blocks.{s.layer}.attn.z", ctx).transpose(1, 2).flatten(2), *a[1:])

    for lay in adapter.layers:
        v_proj, probs = get_path(lay.module, fam.v_proj), get_path(lay.module, fam.probs)
        if fam.qkv_groups:
            handles.append(v_proj.register_forward_hook(lambda m, a, o, lay=lay: fused(o, lay)))
        else:
            handles.append(v_proj.register_forward_hook(lambda m, a, o, h=lay.n_heads: value(o, h)))
        handles.append(probs.register_forward_hook(pattern))
        if any(k.endswith(".attn.z") for k in s.edits):
            handles.append(lay.o_proj.register_forward_pre_hook(lambda m, a, d_h=lay.d_head: z(a, d_h)))
    return handles


def _cache_makers(adapter: Adapter, layers: list[nn.Module]) -> list[nn.Module]:
    """The modules of the base model outside its layers whose forward takes `use_cache` (the base model, OPT's
    decoder inside it): where a key / value cache is made."""
    inside = {id(m) for lay in layers for m in lay.modules()}
    return [
        m
        for m in adapter.base.modules()
        if id(m) not in inside and "use_cache" in inspect.signature(m.forward).parameters
    ]


def _no_cache(m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The base model called with `use_cache=False`: a pass whose layers are recomputed keeps no key / value cache
    (a layer's recomputation would extend it)."""
    return args, {**kwargs, "use_cache": False}


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _taking(scale: float = 1.0, half: int | None = None) -> Callable[[tuple, Any], torch.Tensor]:
    """A capture of a module's output: times `scale` (Granite's residual multiplier), or one half of it (a fused
    [gate | up] projection: 0 the gate, 1 the up projection)."""

    def take(args: tuple, out: Any) -> torch.Tensor:
        t = _first(out)
        t = t if half is None else t.chunk(2, -1)[half]
        return t if scale == 1.0 else t * scale

    return take


def _unit_mix(mix: Callable[[nn.Module, tuple, torch.Tensor], None], unit: nn.Module) -> Callable[..., None]:
    """The `mix` capture at the input of the module that the attention residual sum feeds, where no norm follows the
    sum (OLMo 2): the norm's output is the adapter's identity map of it (`identity_norm`), in float32."""

    def hook(m: nn.Module, args: tuple, out: Any) -> None:
        mix(m, args, unit(args[0].float()))

    return hook


def _hidden(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """The hidden states a layer module is called with (first positional argument or `hidden_states=`)."""
    return args[0] if args else kwargs["hidden_states"]


def edit_point_names(n_layers: int) -> str:
    """The valid edit point names of a model with `n_layers` layers, in words (for error messages)."""
    return ", ".join(["embed", *(f"blocks.{{l}}.{p}" for p in BLOCK_POINTS)]) + f" (l = 0..{n_layers - 1})"


def _check(
    adapter: Adapter, edits: dict[str, Edit], start: int, stop_after: int | None, resid_pre: torch.Tensor | None
) -> int:
    """Validate the layer range and the edit point names → the last layer run."""
    n = adapter.n_layers
    if not 0 <= start < n:
        raise MixlensError(f"start layer {start} out of range; the model has {n} layers (0..{n - 1})")
    stop = n - 1 if stop_after is None else stop_after
    if not start <= stop < n:
        raise MixlensError(f"stop_after layer {stop_after} out of range; valid: {start}..{n - 1}")
    if start > 0 and resid_pre is None:
        raise MixlensError(f"start={start} needs resid_pre, the residual stream entering layer {start}")
    for name in edits:
        m = _POINT.fullmatch(name)
        if name == "embed" and start > 0:
            raise MixlensError(f"edit point 'embed' is not run when the forward pass starts at layer {start}")
        if name != "embed" and m is None:
            raise MixlensError(f"unknown edit point '{name}'; valid: {edit_point_names(n)}")
        if m is not None and not 0 <= int(m[1]) < n:
            raise MixlensError(f"layer {m[1]} out of range in edit point '{name}'; valid: {edit_point_names(n)}")
        if m is not None and not start <= int(m[1]) <= stop:
            raise MixlensError(f"edit point '{name}' is outside the layers run ({start}..{stop})")
    return stop


@contextmanager
def hooked(
    adapter: Adapter,
    edits: Mapping[str, Edit] | None = None,
    ffn: FfnCapture = False,
    *,
    start: int = 0,
    resid_pre: torch.Tensor | None = None,
    stop_after: int | None = None,
    stop_at_mix: bool = False,
    on_layer: Callable[[int], None] | None = None,
    qk_rows: bool = False,
    fused_attention: bool = False,
) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Capture hooks and `edits` (edit point name → fn, see the module docstring) for ONE model call.

    Yields the record, filled during the call: name → one tensor per layer run, in layer order (item k is layer
    start + k): `x`, `out`, `attn_out`, `mix_in`, `mix_out`, `alpha`, `value`, with `ffn=True` also `ffn_pre`,
    `ffn_act`, `ln_out_in`, `ffn_gate`, with `ffn="update"` only `ffn_update` (shapes as in `LayerTrace`).

    - `start`, `resid_pre` [B, n, d]: feed resid_pre into layer `start` and run only the layers from it on
      (resid_pre is needed when start > 0; at start 0 it replaces the embedding output).
    - `stop_after`: end the forward pass right after the output of that layer; `stop_at_mix`: right after its
      ln_mix instead (default layer: the last). A stopped forward pass leaves the `with` body at once (the
      model call returns nothing): read the layer outputs from the record.
    - `on_layer(k)`: called as soon as item k of the record is complete: at the layer's output, or at its ln_mix
      for a pass stopped there (the record may be thinned in it, e.g. α dropped).
    - `qk_rows`: attention through `ALL_ATTENTION_FUNCTIONS` records a `rowattn.QKRows` in `alpha` instead of α
      (no [B, H, n, n] tensor; not with attention edits of that layer). The family's own route (MPNet) records α.
    - `fused_attention`: attention through `ALL_ATTENTION_FUNCTIONS` runs in torch's fused kernels
      (`scaled_dot_product_attention`) and records neither α nor v: a gradient pass (saliency, AttnLRP) then keeps no
      [B, H, n, n] per layer for its backward. Not for layers with attention edits, nor with a logit soft-cap
      (Gemma 2: eager, as without it); the family's own route (MPNet) is unchanged.

    Inside `recomputed_layers()` and under grad mode, the call records nothing (the record stays empty) and each
    layer runs under activation checkpointing (see `recomputed_layers`).
    """
    edits = dict(edits or {})
    stop = _check(adapter, edits, start, stop_after, resid_pre)
    edits = _with_defaults(adapter, edits, start, stop)
    extra = _RECOMPUTE.get() if torch.is_grad_enabled() else None
    s = _Session(adapter, edits, start, stop, qk_rows, fused_attention, record=extra is None)
    rec = s.rec
    halt_out = stop_after is not None and not stop_at_mix
    modules = list({id(lay.module): lay.module for lay in adapter.layers}.values())  # ALBERT shares them
    handles: list[torch.utils.hooks.RemovableHandle] = []
    forwards: list[tuple[nn.Module, Any]] = []  # (module, its own instance `forward` or None): skipped layers, MPNet
    seen: set[tuple[int, str]] = set()

    def enter(m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        layer = s.enter(m)
        if not s.active:
            return None
        h = _hidden(args, kwargs)
        h = resid_pre.to(h.dtype) if layer == start and resid_pre is not None else h
        h = s.edit(f"blocks.{layer}.resid_pre", h)
        if s.record:
            rec["x"].append(h)
        return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

    def complete() -> None:
        if on_layer is not None:
            on_layer(s.layer - start)

    def leave(m: nn.Module, args: tuple, out: Any) -> None:
        if s.active:
            if s.record:
                rec["out"].append(_first(out))
            complete()
            if halt_out and s.layer == stop:
                raise _Stop(s)

    def tokens(t: torch.Tensor) -> torch.Tensor:
        """[B, n, ...] as the layer input: OPT runs its FFN block on [B·n, d]."""
        x = rec["x"][-1]
        return t if t.dim() == x.dim() else t.view(*x.shape[:2], -1)

    def mix(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if s.active:
            if s.record:
                rec["mix_in"].append(tokens(args[0]))
                rec["mix_out"].append(tokens(out))
            if stop_at_mix and s.layer == stop:
                complete()
                raise _Stop(s)

    def embed(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if s.embedded:  # GPT-2 also embeds token_type_ids with the same module, after the token ids
            return None
        s.embedded = True
        return s.edit("embed", out)

    def skipping(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if _SESSION.get() is s and s.layer < start:
                h = _hidden(args, kwargs)
                return (h, None) if adapter.family.layer_tuple else h
            return inner(*args, **kwargs)

        return forward

    def recomputed(inner: Callable[..., Any], extra: Callable[[], AbstractContextManager[Any]]) -> Callable[..., Any]:
        """The layer's forward under non-reentrant activation checkpointing: its backward runs it again (`inner`,
        not the module call, so the layer pre- and post-hooks fire once) inside `_recomputing`."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            if _SESSION.get() is not s or not s.active or not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            layer, n = s.layer, int(_hidden(args, kwargs).shape[-2])
            release(n)  # the previous layer's freed transients back to the system (a long input)

            def contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
                # a fresh `_recomputing` each time the backward enters it: several backward passes through one
                # forward (retain_graph, an answer's batches of rows) each recompute the layer
                return nullcontext(), _EachTime(lambda: _recomputing(s, layer, n, extra))

            return checkpoint(inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        return forward

    def parallel_sum(lay: Layer, attn_out: torch.Tensor) -> None:
        """A parallel block's attention residual sum x + attention output (float32), through its identity ln_mix,
        whose hooks record it as `mix_in` and `mix_out` (the block itself never forms it)."""
        if s.active and s.record:
            lay.ln_mix.module(rec["x"][-1].float() + attn_out.float())

    def capture(mod: nn.Module | None, name: str, take: Callable[[tuple, Any], torch.Tensor]) -> None:
        if mod is None or (id(mod), name) in seen:  # ALBERT: a shared module fires once per layer
            return
        seen.add((id(mod), name))

        def hook(m: nn.Module, args: tuple, out: Any) -> None:
            if s.active and s.record:
                rec[name].append(tokens(take(args, out)))

        handles.append(mod.register_forward_hook(hook))

    lock = _model_lock(adapter)
    lock.acquire()
    try:
        for mod in modules:
            handles.append(mod.register_forward_pre_hook(enter, with_kwargs=True))
            handles.append(mod.register_forward_hook(leave))
            if s.indices[id(mod)][0] < start or extra is not None:
                forwards.append((mod, vars(mod).get("forward")))
            if s.indices[id(mod)][0] < start:
                mod.forward = skipping(mod.forward)
            if extra is not None:
                mod.forward = recomputed(mod.forward, extra)
        if extra is not None:
            for mod in _cache_makers(adapter, modules):
                handles.append(mod.register_forward_pre_hook(_no_cache, with_kwargs=True))
        if "embed" in edits:
            lookup: nn.Module = adapter.base.get_input_embeddings()
            handles.append(lookup.register_forward_hook(embed))
        if adapter.family.probs is not None:
            if s.inplace:  # before the route's hooks: the check runs the module's own forward
                for lay in adapter.layers:
                    fast = inplace.forward_for(lay.attn)
                    if fast is not None:
                        forwards.append((lay.attn, vars(lay.attn).get("forward")))
                        lay.attn.forward = fast
            handles += _module_route(adapter, s)
        for lay in adapter.layers:
            scale = lay.branch_scale  # Granite's residual multiplier: the outputs as they enter the residual stream
            capture(lay.o_proj, "attn_out", _taking(scale))
            capture(lay.proj, "post_raw", _taking())
            fed = lay.mix_at or lay.ln_mix.module  # the module the attention residual sum feeds
            if (id(fed), "mix") not in seen:
                seen.add((id(fed), "mix"))
                if lay.mix_at is None:
                    handles.append(fed.register_forward_hook(mix))
                else:  # no norm after the sum (OLMo 2): the sum itself, as a parallel block's
                    handles.append(fed.register_forward_hook(_unit_mix(mix, lay.ln_mix.module)))
            if adapter.family.parallel:
                handles.append(lay.o_proj.register_forward_hook(lambda m, a, o, lay=lay: parallel_sum(lay, _first(o))))
            if ffn == "update":
                capture(lay.ffn_out, "ffn_update", _taking(scale))
            elif ffn:
                fused = lay.fused_gate_up  # a fused [gate | up] projection: its halves
                capture(lay.ffn_in, "ffn_pre", _taking(half=1 if fused else None))
                capture(lay.ffn_out, "ffn_act", lambda a, o: a[0])
                capture(lay.ln_out.module if lay.ln_out else None, "ln_out_in", lambda a, o: a[0])
                capture(lay.ffn_gate, "ffn_gate", _taking(half=0 if fused else None))
        token = _SESSION.set(s)
        try:
            with _eager_wrapped():
                yield rec
        except _Stop as e:
            if e.session is not s:
                raise
        finally:
            _SESSION.reset(token)
    finally:
        for h in handles:
            h.remove()
        for mod, own in forwards:
            if own is None:
                del mod.forward
            else:
                mod.forward = own
        lock.release()


_RECOMPUTE: contextvars.ContextVar[Callable[[], AbstractContextManager[Any]] | None] = contextvars.ContextVar(
    "mixlens_recompute", default=None
)


@contextmanager
def recomputed_layers(extra: Callable[[], AbstractContextManager[Any]] = nullcontext) -> Iterator[None]:
    """Within the context, a gradient pass (`hooked` under grad mode) keeps only each layer's input for its backward
    and runs the layer again during the backward (`torch.utils.checkpoint`, non-reentrant): a long input's backward
    then holds one layer's activations at a time plus every layer's input, L · B · n · d, instead of every layer's
    activations. The layer's recomputation runs with the pass's session live again (its edits, fused attention,
    layer index) and with `extra()` entered; forward hooks installed on the model's modules (`scoped_hooks`) fire
    again, so the backward must run while they are installed. The recomputed values are the forward's own (same
    inputs, same operations), so the gradient is the one the pass would give without recomputation. Such a pass
    records nothing: for gradient passes only, not traces."""
    token = _RECOMPUTE.set(extra)
    try:
        yield
    finally:
        _RECOMPUTE.reset(token)


@contextmanager
def _recomputing(
    s: _Session, layer: int, n_tokens: int, extra: Callable[[], AbstractContextManager[Any]]
) -> Iterator[None]:
    """The context of layer `layer`'s recomputation in a backward (any thread): session `s` current at that layer,
    transformers' eager attention wrapped, `extra()` entered; freed memory handed back first (`memory.release`: the
    previous layer's backward transients on a long input)."""
    release(n_tokens)
    token = _SESSION.set(s)
    before, s.layer = s.layer, layer
    try:
        with _eager_wrapped(), extra():
            yield
    finally:
        s.layer = before
        _SESSION.reset(token)


class _EachTime(AbstractContextManager[None]):
    """A context manager that may be entered many times, nested or not: each entry enters a fresh one of `make()`
    (a generator-based one may be entered once)."""

    def __init__(self, make: Callable[[], AbstractContextManager[Any]]) -> None:
        self.make = make
        self.entered: list[AbstractContextManager[Any]] = []

    def __enter__(self) -> None:
        cm = self.make()
        cm.__enter__()
        self.entered.append(cm)

    def __exit__(self, *exc: Any) -> bool | None:
        return self.entered.pop().__exit__(*exc)


def f32(t: torch.Tensor | None) -> Any:
    """`t` in float32 (the same tensor when it is already float32, or not floating point)."""
    return t if t is None or t.dtype == torch.float32 or not t.is_floating_point() else t.float()


def _layer_trace(adapter: Adapter, rec: dict[str, list[torch.Tensor]], k: int) -> LayerTrace:
    """Item k of a complete record (layer k of a pass started at layer 0) as a LayerTrace, in float32: a forward
    pass in bfloat16 or float16 is captured as it ran and upcast here, so that every method accumulates in float32."""

    def opt(name: str) -> torch.Tensor | None:
        return f32(rec[name][k]) if len(rec.get(name, ())) > k else None

    ln_post, post_raw = adapter.layers[k].ln_post, opt("post_raw")
    alpha, qk = rec["alpha"][k], None
    if isinstance(alpha, QKRows):
        qk, alpha = alpha, rec["x"][k].new_empty(0)
    return LayerTrace(
        qk=qk,
        x=f32(rec["x"][k]),
        alpha=f32(alpha),
        value=f32(rec["value"][k]),
        attn_out=f32(rec["attn_out"][k]),
        mix_in=f32(rec["mix_in"][k]),
        mix_out=f32(rec["mix_out"][k]),
        out=opt("out"),
        ffn_pre=opt("ffn_pre"),
        ffn_act=opt("ffn_act"),
        ln_out_in=opt("ln_out_in"),
        ffn_gate=opt("ffn_gate"),
        ffn_update=opt("ffn_update"),
        post_scale=None if post_raw is None or ln_post is None else ln_post.scale(post_raw.float()),
    )


def run_traced(
    adapter: Adapter,
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    edits: Mapping[str, Edit] | None = None,
    ffn: FfnCapture = False,
    tokenizer: object | None = None,
    to_output: bool = True,
    sink: LayerSink | None = None,
    qk_rows: bool = False,
    head: bool = True,
    logit_at: torch.Tensor | None = None,
) -> Trace:
    """One forward pass with capture hooks → Trace (call under torch.no_grad() for analysis). `to_output=False`
    stops after the last layer's ln_mix: everything the attention-block methods use, without the last FFN and
    the model head (the last layer's `out` and the logits are then None).

    `sink(l, layer_trace)` is called inside the forward pass as soon as layer l is complete (its output, or its
    ln_mix for the last layer when `to_output=False`), with everything a trace holds of it; then that layer's
    tensors are dropped (the trace keeps empty ones, and `post_scale`), so at most one layer's α [B, H, n, n] is
    alive at a time and the trace holds O(layers · n) floats: the sink keeps what it needs. Every captured tensor,
    the logits and the hidden states are float32, whatever the dtype the model ran in (`f32`). `qk_rows`: see
    `hooked` (each LayerTrace then has `qk` and an empty `alpha`). `head=False`: run the adapter's base model only
    (the layers and the final norm, not the model head): `Trace.logits` is None and `Trace.hidden` the base model's
    output, for methods that do not read the head (a causal LM's logits are [B, n, vocabulary] floats). `logit_at`
    [K] (sorted positions; a model whose forward takes `logits_to_keep`): the head computes the logits at those
    positions only (`Trace.logits` [B, K, V], `Trace.logit_at`, read through `Trace.logit_rows`)."""
    output = None
    thin: list[LayerTrace] = []  # the consumed layers, as the trace keeps them

    def consume(k: int) -> None:
        assert sink is not None
        lt = _layer_trace(adapter, rec, k)
        sink(k, lt)
        empty = lt.x.new_empty(0)
        for items in rec.values():
            if len(items) > k:
                items[k] = empty
        thin.append(LayerTrace(empty, empty, empty, empty, empty, empty, empty, post_scale=lt.post_scale))

    n_tokens = int(inputs["input_ids"].shape[-1]) if "input_ids" in inputs else 0

    def layer_done(k: int) -> None:
        if sink is not None:
            consume(k)  # a sink releases memory itself
        else:
            release(n_tokens)  # a long input: the layer's freed transients back to the system (`mixlens.memory`)

    if not qk_rows and "input_ids" in inputs:  # α of every layer (one with a sink) is kept: does it fit?
        batch, heads = int(inputs["input_ids"].shape[0]), adapter.n_heads
        kept = 1 if sink is not None else adapter.n_layers
        check_fits(
            attention_bytes(batch, n_tokens, adapter.n_layers, heads, kept),
            f"a trace of {batch} × {n_tokens} tokens ({kept} layer(s) × {heads} heads of [n, n] attention kept)",
            "use fewer or shorter inputs, or the row mode (--rows last: no [n, n] attention kept)",
            inputs["input_ids"].device,
        )
    on_layer = layer_done if sink is not None or n_tokens >= LONG_TOKENS else None
    call = {**inputs, "use_cache": False} if adapter.family.causal else inputs  # one pass: no key / value cache
    if logit_at is not None and head:
        call = {**call, "logits_to_keep": logit_at.to(inputs["input_ids"].device)}
    with hooked(
        adapter, edits, ffn if to_output else False, stop_at_mix=not to_output, on_layer=on_layer, qk_rows=qk_rows
    ) as rec:
        output = (model if head else adapter.base)(**call)
    n = adapter.n_layers
    counts = {k: len(rec[k]) for k in ("x", "attn_out", "mix_in", "mix_out", "alpha", "value")}
    counts["out"] = len(rec["out"]) + (0 if to_output else 1)
    for key, count in counts.items():
        if count != n:
            raise RuntimeError(f"capture of '{key}' fired {count} times for {n} layers")
    layers = thin
    if sink is None:
        for i in range(n):  # a bfloat16 / float16 record is upcast one layer at a time, each dropped when copied
            layers.append(_layer_trace(adapter, rec, i))
            for items in rec.values():
                if len(items) > i:
                    items[i] = layers[i].x.new_empty(0)
    logits = f32(getattr(output, "logits", None))
    hidden = f32(getattr(output, "last_hidden_state", None)) if logits is None else None
    rows_kept = None if logit_at is None or logits is None else logit_at.to(logits.device)
    return Trace(adapter, model, inputs, layers, logits, tokenizer, hidden=hidden, logit_at=rows_kept)
