"""Whether a batch of `evaluate` or `explain` fits the machine's memory, said before any pass of it runs
(`check_batch`).

The estimate (float32 bytes, batch B, n tokens, L layers, H heads, width d, vocabulary V; `mixlens.memory`) is what
the batch holds at once: its trace while the methods run, the methods' results, plus the largest of its passes:

- the trace: a streamed one (causal LM, every method reading the trace computes the explained row alone:
  `pipeline.stream_trace`) keeps the logits of the explained rows and one layer's activations; a kept one every layer's
  tensors, about `TRACE_FLOATS` · d per token and layer (q and K in row mode, α [B, H, n, n] per layer else:
  `memory.attention_bytes`) and the logits; without a method that reads it, the forward that reads the targets
  (a causal LM's in fused attention with the last tokens' logits; others' logits and an eager layer's attention
  transients);
- the results: `memory.result_bytes` (one target row for the methods computing the explained row only);
- the passes: each gradient method's and the agreement reference's backward (`memory.backward_bytes`; integrated
  gradients in their chunks, DeepLift with its baseline rows), each forward-only method's own forwards (an eager
  layer's attention transients) and the perturbed forwards of the removal curves (a causal LM's in fused attention:
  one layer's activations of one chunk; other models' an eager layer's attention transients).

A request over the memory available is one line naming the input, its length, the estimate and what is available
(`MixlensError`, exit code 2), instead of the kernel's out-of-memory kill after minutes of work.
"""

from __future__ import annotations

from collections.abc import Sequence

from mixlens import memory
from mixlens.errors import MixlensError
from mixlens.memory import attention_bytes, backward_bytes, result_bytes
from mixlens.methods import get as get_method
from mixlens.pipeline import qk_trace, trace_flags

TRACE_FLOATS = 9  # floats per token, layer and hidden dim a kept trace holds (x, out, the attention block's
# in- and outputs, v; q and K in row mode): 1.2 GB at 2,015 tokens on SmolLM2, besides its logits


def row_only(methods: Sequence[str], kind: str) -> list[str]:
    """The methods that compute only the explained row for a model of this kind (`Method.row_mode` on causal and
    masked LMs, whose explained row is one position)."""
    return [m for m in methods if get_method(m).row_mode] if kind in ("causal", "masked") else []


def batch_bytes(
    lens,
    methods: Sequence[str],
    batch: int,
    n: int,
    *,
    streamed: bool,
    one_row: Sequence[str] = (),
    reference: bool = True,
    removal: bool = True,
    forward_cells: int = 1 << 23,
) -> dict[str, int]:
    """The estimate's parts, in bytes: {'trace', 'results', 'pass'} for `batch` inputs of `n` tokens and `methods`
    (registry names; `one_row`: those computing only the explained row), with evaluate's agreement reference
    (`reference`) and perturbed forwards (`removal`, in chunks of ≤ `forward_cells` token pairs)."""
    adapter, model = lens.adapter, lens.model
    layers, heads = adapter.n_layers, adapter.n_heads
    d = adapter.base.get_input_embeddings().embedding_dim
    vocab = int(getattr(model.config, "vocab_size", 0) or 0) if adapter.family.causal else 0
    d_ff = int(getattr(model.config, "intermediate_size", 0) or 4 * d)
    logits = 4 * batch * n * vocab
    one_layer = backward_bytes(batch, n, 0, d)  # a layer's activations while it runs
    eager = attention_bytes(batch, n, layers, heads, 0)  # an eager layer's [B, H, n, n] transients
    readers = [m for m in methods if not get_method(m).inputs_only]
    if streamed:  # the logits of the explained rows only (each input's last token)
        trace = 4 * batch * min(batch, n) * vocab + one_layer
    elif readers:
        ffn, _ = trace_flags(readers)
        per_token = TRACE_FLOATS * d + (3 * d_ff if ffn is True else 0)
        trace = 4 * batch * n * layers * per_token + logits
        trace += one_layer if qk_trace(readers, adapter) else attention_bytes(batch, n, layers, heads, layers)
    elif adapter.family.causal:  # the targets read from one plain pass in fused attention: the last tokens' logits
        trace = 4 * batch * min(batch, n) * vocab + one_layer
    else:
        trace = logits + eager
    results = sum(
        result_bytes(
            [get_method(m).dims], batch=batch, n=n, layers=layers, heads=heads, rows=1 if m in one_row else None
        )
        for m in methods
    )
    passes = [0]
    for m in methods:
        spec = get_method(m)
        if spec.backward:
            rows = batch if spec.backward_rows is None else spec.backward_rows(batch, n)
            passes.append(backward_bytes(rows, n, layers, d))
        elif spec.extra_passes:
            passes.append(eager)
    if reference:
        passes.append(backward_bytes(batch, n, layers, d))
    if removal:  # a causal LM's run in fused attention (`scoring.fused`): one layer's activations per chunk
        chunk = max(1, min(batch, forward_cells // (n * n)))
        fused_ok = adapter.family.causal and getattr(model.config, "attn_logit_softcapping", None) is None
        passes.append(backward_bytes(chunk, n, 0, d) if fused_ok else attention_bytes(chunk, n, layers, heads, 0))
    return {"trace": trace, "results": results, "pass": max(passes)}


def check_batch(lens, parts: dict[str, int], where: str, n: int, group: str | None = None) -> None:
    """MixlensError, in one line, when the estimate `parts` (`batch_bytes`) of the batch whose longest input is
    `where` (e.g. 'input 3'; of a contrastive task's `group`) with `n` tokens exceeds the memory available on the
    model's device."""
    need = sum(parts.values())
    have = memory.available_bytes(lens.device)
    if have is not None and need > have:
        detail = ", ".join(f"{k} {_size(v)}" for k, v in parts.items())
        size = f"{'' if group is None else group + ', '}{n:,} tokens"
        raise MixlensError(
            f"{where} ({size}) needs about {_size(need)} ({detail}: the trace, the methods' results and the largest "
            f"pass) but {_size(have)} are available; use shorter inputs, or fewer or gradient-free methods"
        )


def _size(b: int) -> str:
    return f"{b / 1e9:.1f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"
