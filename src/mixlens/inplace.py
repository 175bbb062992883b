"""Attention computed in place, for traces: the families' own attention code allocates and writes three or four
[B, H, n, n] tensors per layer (the scores, the scaled scores, the masked scores, the probabilities), which cost
about 10 % of a 512-token forward pass on a CPU; these functions write one, the tensor that becomes α.

They do the same float operations in the same order as the code they stand in for, so they give the same floats.
That is not assumed: `mixlens.trace` uses one only for families with `Family.inplace_attention`, without autograd, and
only after `same_floats` compared it bit for bit with the family's own code on a small input of the same form
(once per function and form); otherwise the family's own code runs. `tests/engine/test_trace.py` checks every family.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

_VERDICTS: dict[tuple, bool] = {}  # (the family's function, the form of the call) → whether ours gives its floats


def may_write_in_place(module: nn.Module, tensor: torch.Tensor) -> bool:
    """Whether this call runs in evaluation mode on plain float32 tensors: no autograd of either mode, no `torch.func`
    transform (a `vmap` of `jvp` wraps the tensors), where in-place writes would break what records or batches them."""
    return not (
        module.training
        or torch.is_grad_enabled()
        or tensor.dtype != torch.float32
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch.autograd.forward_ad.unpack_dual(tensor).tangent is not None
    )


def same_floats(
    key: tuple, ours: Callable[..., tuple], theirs: Callable[..., tuple], inputs: Callable[[], tuple]
) -> bool:
    """Whether `ours(*inputs())` and `theirs(*inputs())` return equal tensors, bit for bit; computed (and the inputs
    made) once per `key`."""
    verdict = _VERDICTS.get(key)
    if verdict is None:
        args = inputs()
        a, b = ours(*args), theirs(*args)
        verdict = _VERDICTS[key] = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return verdict


def softmax_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scaling, soft-capped, + mask) v: an `eager_attention_forward` of transformers (BERT, Llama and
    Gemma forms), evaluation mode. query [B, H, n, d_h], key and value [B, H_kv, n, d_h], mask broadcastable to
    [B, H, n, n] → (z [B, n, H, d_h], α [B, H, n, n])."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # the family's own repeat_kv: the layout it gives decides the matmul's kernel, so the floats
        own = sys.modules[type(module).__module__].repeat_kv
        key, value = own(key, groups), own(value, groups)
    alpha = torch.matmul(query, key.transpose(2, 3))
    alpha.mul_(query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        alpha.div_(softcap).tanh_().mul_(softcap)
    if attention_mask is not None:
        alpha.add_(attention_mask)
    torch.softmax(alpha, -1, out=alpha)  # row by row: each row is read before it is written
    return torch.matmul(alpha, value).transpose(1, 2).contiguous(), alpha


def eager_for(
    eager: Callable[..., tuple], module: nn.Module, query: torch.Tensor, key: torch.Tensor, mask: Any, kwargs: dict
) -> Callable[..., tuple]:
    """`softmax_attention` where it gives the floats of the family's `eager` for a call of this form, else `eager`."""
    if not may_write_in_place(module, query):
        return eager
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dtype == query.dtype and mask.dim() == 4):
        return eager
    h, h_kv, d_h = query.shape[1], key.shape[1], query.shape[-1]
    scalars = tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, int | float | str)))
    others = tuple(sorted(k for k, v in kwargs.items() if v is not None and not isinstance(v, int | float | str)))
    form = (eager, h, h_kv, d_h, mask is None, scalars, others)

    def inputs() -> tuple:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, n, 5, d_h, generator=gen) for n in (h, h_kv, h_kv))
        return module, q, k, v, None if mask is None else _mask(5)

    ours, theirs = (functools.partial(fn, **kwargs) for fn in (softmax_attention, eager))
    return softmax_attention if same_floats(form, ours, theirs, inputs) else eager


def _mask(n: int) -> torch.Tensor:
    """An additive causal mask [1, 1, n, n] with one more source masked, as the models build them."""
    blocked = torch.ones(n, n, dtype=torch.bool).triu(1)
    blocked[-1, 0] = True
    return torch.zeros(1, 1, n, n).masked_fill(blocked, torch.finfo(torch.float32).min)


def mpnet_attention(
    module: MPNetSelfAttention,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, ...]:
    """MPNet's self-attention: o(softmax(q kᵀ / √d_h + position bias + mask) v), through the module's own q, k, v,
    dropout and o submodules (so the trace's hooks on them see every call). hidden_states [B, n, d] → (o [B, n, d],
    α [B, H, n, n] with output_attentions)."""
    shape = (*hidden_states.shape[:-1], -1, module.attention_head_size)
    q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (module.q, module.k, module.v))
    alpha = torch.matmul(q, k.transpose(-1, -2))
    alpha.div_(math.sqrt(module.attention_head_size))
    if position_bias is not None:
        alpha.add_(position_bias)
    if attention_mask is not None:
        alpha.add_(attention_mask)
    torch.softmax(alpha, -1, out=alpha)
    alpha = module.dropout(alpha)
    c = torch.matmul(alpha, v).permute(0, 2, 1, 3).contiguous()
    o = module.o(c.view(*c.shape[:-2], -1))
    return (o, alpha) if output_attentions else (o,)


def forward_for(module: nn.Module) -> Callable[..., tuple] | None:
    """An in-place forward for `module` (MPNet's self-attention) that gives the floats of its own, or None. Call it
    before any trace hook is on the module's submodules: the check runs both forwards. The forward it returns runs
    the module's own where a call may not write in place (`may_write_in_place`)."""
    if not isinstance(module, MPNetSelfAttention) or not may_write_in_place(module, next(module.parameters())):
        return None
    own = type(module).forward
    heads, d = module.num_attention_heads, module.all_head_size

    def inputs() -> tuple:
        gen = torch.Generator().manual_seed(0)
        x, bias = torch.randn(1, 5, d, generator=gen), torch.randn(1, heads, 5, 5, generator=gen)
        return module, x, _mask(5)[:, :, -1:], bias  # [1, 1, 1, n]: MPNet's extended padding mask

    ours, theirs = (functools.partial(fn, output_attentions=True) for fn in (mpnet_attention, own))
    if not same_floats((own, heads, d), ours, theirs, inputs):
        return None

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        # the mode may change after the check
        fn = mpnet_attention if may_write_in_place(module, hidden_states) else own
        return fn(module, hidden_states, *args, **kwargs)

    return forward
