"""The one compute step every loop shares: registry methods on one `Trace`, plus the batch plan by token length.

Loops (`Lens.analyze`, the corpus runner, the head statistics) iterate `Lens.batches(...)` and call
`run_methods` on each batch's trace; nothing else drives the engine internals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mixlens.adapters import Adapter
from mixlens.errors import MixlensError
from mixlens.memory import check_fits, release, result_bytes
from mixlens.methods import get as get_method
from mixlens.methods.engine import BLOCK_NORMS, NORM_RUN, BlockNorms, NormRun, block_norms, stream_layer
from mixlens.methods.memo import Memo, StreamLayer, memo_of
from mixlens.methods.registry import Method, check_options, check_row_mode
from mixlens.trace import FfnCapture, LayerSink, LayerTrace, Trace, run_traced

# which rows of a [layer, target, source] map to compute: "all" / None (full maps), "last", or positions
# (negative: from the end)
Rows = str | Sequence[int] | None


class NotGiven:
    """The default of a deprecated keyword (`Lens.analyze(targets=)`): tells "not passed" from None, a `Rows`."""


NOT_GIVEN = NotGiven()
LONG_CAUSAL = 512  # tokens above which a causal LM's default rows (`auto_rows`) are the last token's


def auto_rows(lengths: Sequence[int], causal: bool) -> str:
    """The default rows of an analysis (`Lens.analyze(rows="auto")`, `mixlens analyze` without
    `--rows`): "last" for a causal LM with an input of over `LONG_CAUSAL` tokens (full maps would hold
    layers · n² per input), else "all"."""
    return "last" if causal and max(lengths, default=0) > LONG_CAUSAL else "all"


LayerProgress = Callable[[str, int, int], None]  # (phase, layers done, layers in the phase): long inputs' progress


def resolve_rows(rows: Rows, lengths: Sequence[int]) -> torch.Tensor | None:
    """Row positions [B, K] (int64) per input of `lengths` real tokens, or None for every row. `rows`: None or
    "all", "last" (each input's last token) or positions (negative ones count from each input's end)."""
    if rows is None or (isinstance(rows, str) and rows == "all"):
        return None
    if isinstance(rows, str):
        if rows != "last":
            raise MixlensError(f"rows must be 'all', 'last' or a list of positions, got {rows!r}")
        return torch.tensor([[n - 1] for n in lengths], dtype=torch.long)
    wanted = list(rows)
    if not wanted or not all(isinstance(t, int) and not isinstance(t, bool) for t in wanted):
        raise MixlensError(f"rows must be 'all', 'last' or a non-empty list of integer positions, got {rows!r}")
    out = []
    for b, n in enumerate(lengths):
        pos = [t + n if t < 0 else t for t in wanted]
        bad = [t for t, p in zip(wanted, pos, strict=True) if not 0 <= p < n]
        if bad:
            raise MixlensError(f"row position {bad[0]} is outside input {b + 1} ({n} tokens)")
        if len(set(pos)) < len(pos):
            raise MixlensError(f"rows {wanted} name the same position twice in input {b + 1} ({n} tokens)")
        out.append(pos)
    return torch.tensor(out, dtype=torch.long)


def plan_batches(
    lengths: Sequence[int], batch_size: int, max_tokens: int | None = None, max_cells: int | None = None
) -> list[list[int]]:
    """Positions grouped into batches, longest first: ≤ batch_size items, ≤ max_tokens padded tokens and ≤ max_cells
    padded token pairs (items · n², what the [.., n, n] maps hold); an input over a limit gets a batch of its own.
    Ties keep input order (deterministic)."""
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    batches: list[list[int]] = []
    for k in order:
        b = batches[-1] if batches else None
        n, m = (lengths[b[0]], len(b) + 1) if b else (0, 1)
        if (
            b
            and m <= batch_size
            and (max_tokens is None or m * n <= max_tokens)
            and (max_cells is None or m * n * n <= max_cells)
        ):
            b.append(k)
        else:
            batches.append([k])
    return batches


@dataclass
class MethodResults:
    """What `run_methods` computed on one trace. `values[name]` [batch, *dims] (padding 0); `extras[name]` the
    method's secondary outputs (name → [batch, *axes declared by the method]; empty when none); `norms` is the norm
    engine's result (mixing ratios `norms.ratio`, reconstruction error `norms.error`, `norms.bias`) when a
    requested method used it, else None."""

    values: dict[str, torch.Tensor]
    norms: BlockNorms | None
    extras: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


@torch.no_grad()
def run_methods(
    trace: Trace,
    methods: Sequence[str],
    *,
    heads: bool = False,
    options: dict[str, dict[str, object]] | None = None,
    rows: Rows = None,
) -> MethodResults:
    """Run registry `methods` (names) on `trace` (options per method name; checked by the registry). The norm
    engine (`block_norms`, with its exactness check) runs only when one of the methods uses it: the norm
    engine's own methods run it first, so its by-products (the head-mean α) are shared.

    `rows` (see `resolve_rows`): compute and return only those rows of the target axis, values [batch, layer,
    (head,) K, source] (row k of input b: position `resolve_rows(rows, trace.lengths)[b, k]`); mixing ratios stay
    per token. Methods that do not declare `row_mode` are refused."""
    specs = [get_method(m) for m in dict.fromkeys(methods)]
    options = check_options([s.name for s in specs], options)
    positions = resolve_rows(rows, trace.lengths)
    if positions is not None:
        check_row_mode([s.name for s in specs])
        positions = positions.to(trace.mask.device)
    memo = memo_of(trace)
    old = memo.rows
    same = (
        old is None and positions is None or old is not None and positions is not None and torch.equal(old, positions)
    )
    if memo.streamed and (not same or not {s.name for s in specs} <= memo.streamed):
        raise MixlensError(
            f"this trace was streamed for methods {', '.join(sorted(memo.streamed))} and its rows only "
            "(its attention maps are gone): trace the input again for other methods or rows"
        )
    if not same:
        trace.memo = memo = Memo()  # results of other rows
    if positions is not None:
        memo.rows = positions
    k = None if positions is None else int(positions.shape[1])
    b, n = trace.mask.shape
    check_results(trace.adapter, specs, heads, (b, n), k, trace.mask.device)  # before computing
    if any(s.engine for s in specs) or memo.get(NORM_RUN) is not None:
        block_norms(trace)  # a streamed trace's norm passes ran: their per-run check runs here
    outs = {s.name: s.run(trace, heads=heads, **options.get(s.name, {})) for s in specs}
    values = {k: o.values for k, o in outs.items()}
    return MethodResults(values, memo.get(BLOCK_NORMS), {k: o.extras for k, o in outs.items()})


def check_results(
    adapter: Adapter,
    specs: Sequence[Method],
    heads: bool,
    shape: tuple[int, int],
    rows: int | None,
    device: object = "cpu",
) -> None:
    """MixlensError, in one line, when the results of `specs` on a batch of `shape` (inputs, tokens), K = `rows`
    target rows (None: all), cannot fit the memory available (`memory.result_bytes`)."""
    batch, n = shape
    need = result_bytes(
        [s.dims_for(heads) for s in specs], batch=batch, n=n, layers=adapter.n_layers, heads=adapter.n_heads, rows=rows
    )
    axes = "[layer, head, " if heads else "[layer, "
    what = f"computing {', '.join(s.name for s in specs)} on {batch} × {n} tokens ({axes}{rows or 'n'}, n] results)"
    hint = "use fewer or shorter inputs" + ("" if rows else ", or fewer rows (--rows last)")
    check_fits(need, what, hint, device)


def streams(methods: Sequence[str], rows: Rows) -> bool:
    """Whether `methods` with `rows` run in row streaming mode (`stream_trace`): some rows (not all), and every
    method able to compute them."""
    some = not (rows is None or isinstance(rows, str) and rows == "all")
    return some and all(get_method(m).row_mode for m in methods)


class LayerStream:
    """The layer sink of row streaming (`run_traced(sink=)`): at each layer, while its tensors are alive,
    keeps only what `methods` read afterwards (on `memo`, the streamed trace's Memo):

    - `layer_rows["alpha"]`: the target rows of α [B, H, K, n] (attention, per-head norm maps);
    - the norm engine's token and attention passes (`norms.stream_layer`): the target rows of the pair maps, the
      per-token quantities and what the per-run check needs, when a norm-engine method (`Method.engine`) or a
      method's stream (`Stream.norm_run`) needs them;
    - what each requested method's own sink keeps (`Method.stream`; one call per layer and stream key, `whole`
      when a method of that key propagates rows through every layer, as a rollout does).

    Causal LMs trace in row mode (`run_traced(qk_rows=True)`, `mixlens.rowattn`): no layer ever holds α [B, H, n, n];
    a rollout's layer rows are computed when the propagation reaches the layer, from what its sink keeps of it (q,
    K and the softmax normaliser; ALTI also the residual sum, v and its self pairs). Memory: layers · (H + maps) · K ·
    n, plus per requested rollout layers · n² (other families) or layers · n · (H + H_kv) · d_h (+ d + H_kv · d_h + 1
    for ALTI) in row mode."""

    def __init__(
        self,
        adapter: Adapter,
        mask: torch.Tensor,
        methods: Sequence[str],
        rows: torch.Tensor,
        on_layer: LayerProgress | None = None,
    ):
        self.adapter, self.mask, self.rows, self.on_layer = adapter, mask, rows, on_layer
        specs = [get_method(m) for m in dict.fromkeys(methods)]
        family = adapter.family
        self.sinks: dict[str, tuple[Callable[[StreamLayer, bool], None], bool]] = {}
        for stream in (s.stream for s in specs if s.stream is not None):
            _, whole = self.sinks.get(stream.key, (stream.sink, False))
            self.sinks[stream.key] = (stream.sink, whole or stream.whole)
        streams = [s.stream for s in specs if s.stream is not None]
        self.memo = Memo(rows=rows, streamed=frozenset(s.name for s in specs), progress=on_layer)
        if any(s.engine for s in specs) or any(st.norm_run(family) for st in streams):
            self.memo.put(NORM_RUN, NormRun.start(adapter, mask, rows))
        self.every_row = any(st.whole and st.norm_run(family) for st in streams)  # pair maps of any row, for a sink

    def __call__(self, index: int, lt: LayerTrace) -> None:
        """Take layer `index`'s trace: keep the target rows' attention, run the norm engine's layer step when
        needed and hand the layer to each method's sink."""
        layer = StreamLayer(index, lt, self.adapter.layers[index], self.adapter.family, self.mask, self.rows, self.memo)
        layer.keep("alpha", lt.alpha_rows(self.rows))
        run = self.memo.get(NORM_RUN)
        if run is not None:
            layer.pairs = stream_layer(run, lt, index, self.every_row)
        for sink, whole in self.sinks.values():
            sink(layer, whole)
        release(self.mask.shape[1])
        if self.on_layer is not None:
            self.on_layer("forward pass", index + 1, self.adapter.n_layers)


@torch.no_grad()
def stream_trace(
    adapter: Adapter,
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    methods: Sequence[str],
    rows: Rows,
    tokenizer: object | None = None,
    on_layer: LayerProgress | None = None,
    output: bool = False,
    logit_at: torch.Tensor | None = None,
    also: LayerSink | None = None,
) -> Trace:
    """One forward pass in row streaming mode for `methods` (all declaring `row_mode`) and `rows` (not
    all rows): each layer is consumed by a `LayerStream` as soon as it is complete and its α dropped, so the trace
    never holds the layers' n × n attention maps. `run_methods(trace, methods, rows=rows)` then finishes
    (rollout row propagation, the per-run check) from what the stream kept; other methods or rows are refused.
    `output`: the pass also runs the model head (`Trace.logits`; with `logit_at` [K], of those positions only).
    `also(l, layer_trace)`: another sink, handed each complete layer after the stream (the whole forward pass then
    runs, as with `output`)."""
    mask = inputs["attention_mask"].bool()
    positions = resolve_rows(rows, mask.sum(-1).tolist())
    if positions is None:
        raise MixlensError("streaming computes some rows: give rows other than 'all'")
    check_row_mode(methods)
    stream = LayerStream(adapter, mask, methods, positions.to(mask.device), on_layer)
    capture = any(s.stream is not None and s.stream.capture(adapter.family) for s in map(get_method, methods))
    output = output or also is not None

    def both(index: int, lt: LayerTrace) -> None:
        stream(index, lt)
        if also is not None:
            also(index, lt)

    # the sink is the only reader: FFN activations and layer outputs only for a stream that asks (GlobEnc's LN2)
    trace = run_traced(
        adapter,
        model,
        inputs,
        ffn=capture,
        tokenizer=tokenizer,
        to_output=capture or output,
        sink=both,
        qk_rows=adapter.family.causal,
        logit_at=logit_at if output else None,
    )
    trace.memo = stream.memo
    return trace


def trace_flags(methods: Sequence[str]) -> tuple[FfnCapture, bool]:
    """(ffn, to_output) of the trace that `methods` need: what of the FFN (`trace.FfnCapture`: its activations if
    any method needs them, else its output if one needs that), and the whole forward pass."""
    specs = [get_method(m) for m in methods]
    wanted = {s.needs_ffn for s in specs}
    ffn: FfnCapture = True if True in wanted else "update" if "update" in wanted else False
    return ffn, any(s.needs_output for s in specs)


def qk_trace(methods: Sequence[str], adapter: Adapter) -> bool:
    """Whether a trace for `methods` keeps q and K instead of α (`run_traced(qk_rows=True)`): a causal LM, and
    every method that reads the trace reads α only by rows (`Method.qk_rows`); the methods running their own passes
    from the inputs alone (`inputs_only`: AttnLRP, the gradient methods) read no α, so they do not decide."""
    readers = [m for m in methods if not get_method(m).inputs_only]
    return adapter.family.causal and bool(readers) and all(get_method(m).qk_rows for m in readers)


def needs_capture(methods: Sequence[str]) -> bool:
    """Whether `methods` read the captured forward pass (the methods declaring `inputs_only`, e.g. saliency or
    occlusion, run their own passes from the inputs alone)."""
    return any(not get_method(m).inputs_only for m in methods)
