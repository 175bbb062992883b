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
from mixlens.memory import release
from mixlens.methods import alti, globenc, rollout
from mixlens.methods import get as get_method
from mixlens.methods.engine import BlockNorms, NormRun, block_norms, stream_layer
from mixlens.methods.memo import LayerRowsFactory, Memo, RowsFn, gathered, memo_of
from mixlens.methods.registry import check_options, check_target_rows
from mixlens.trace import FfnCapture, LayerTrace, Trace, run_traced

Targets = str | Sequence[int] | None  # "all" / None (full maps), "last", or positions (negative: from the end)
LayerProgress = Callable[[str, int, int], None]  # (phase, layers done, layers in the phase): long inputs' progress


def resolve_targets(targets: Targets, lengths: Sequence[int]) -> torch.Tensor | None:
    """Target positions [B, K] (int64) per input of `lengths` real tokens, or None for every row. `targets`: None or
    "all", "last" (each input's last token) or positions (negative ones count from each input's end)."""
    if targets is None or (isinstance(targets, str) and targets == "all"):
        return None
    if isinstance(targets, str):
        if targets != "last":
            raise MixlensError(f"targets must be 'all', 'last' or a list of positions, got {targets!r}")
        return torch.tensor([[n - 1] for n in lengths], dtype=torch.long)
    wanted = list(targets)
    if not wanted or not all(isinstance(t, int) and not isinstance(t, bool) for t in wanted):
        raise MixlensError(f"targets must be 'all', 'last' or a non-empty list of integer positions, got {targets!r}")
    rows = []
    for b, n in enumerate(lengths):
        pos = [t + n if t < 0 else t for t in wanted]
        bad = [t for t, p in zip(wanted, pos, strict=True) if not 0 <= p < n]
        if bad:
            raise MixlensError(f"target position {bad[0]} is outside input {b + 1} ({n} tokens)")
        if len(set(pos)) < len(pos):
            raise MixlensError(f"targets {wanted} name the same position twice in input {b + 1} ({n} tokens)")
        rows.append(pos)
    return torch.tensor(rows, dtype=torch.long)


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
    targets: Targets = None,
) -> MethodResults:
    """Run registry `methods` (names) on `trace` (options per method name; checked by the registry). The norm
    engine (`block_norms`, with its exactness check) runs only when one of the methods uses it: the norm
    engine's own methods run it first, so its by-products (the head-mean α) are shared.

    `targets` (see `resolve_targets`): compute and return only those target rows, values [batch, layer, (head,)
    K, source] (row k of input b: position `resolve_targets(targets, trace.lengths)[b, k]`); mixing ratios stay
    per token. Methods that do not declare `target_rows` are refused."""
    specs = [get_method(m) for m in dict.fromkeys(methods)]
    options = check_options([s.name for s in specs], options)
    rows = resolve_targets(targets, trace.lengths)
    if rows is not None:
        check_target_rows([s.name for s in specs])
        rows = rows.to(trace.mask.device)
    memo = memo_of(trace)
    old = memo.targets
    same = old is None and rows is None or old is not None and rows is not None and torch.equal(old, rows)
    if memo.streamed and (not same or not {s.name for s in specs} <= memo.streamed):
        raise MixlensError(
            f"this trace was streamed for methods {', '.join(sorted(memo.streamed))} and its target rows only "
            "(its attention maps are gone): trace the input again for other methods or targets"
        )
    if not same:
        trace.memo = memo = Memo()  # results of other rows
    if rows is not None:
        memo.targets = rows
    if any(s.engine for s in specs) or memo.norm_run is not None:
        block_norms(trace)  # a streamed trace's norm passes ran: their per-run check runs here
    outs = {s.name: s.run(trace, heads=heads, **options.get(s.name, {})) for s in specs}
    values = {k: o.values for k, o in outs.items()}
    return MethodResults(values, memo.block_norms, {k: o.extras for k, o in outs.items()})


def streams(methods: Sequence[str], targets: Targets) -> bool:
    """Whether `methods` with `targets` run in target-row streaming mode (`stream_trace`): target rows, and every
    method able to compute them."""
    rows = not (targets is None or isinstance(targets, str) and targets == "all")
    return rows and all(get_method(m).target_rows for m in methods)


class LayerStream:
    """The layer sink of target-row streaming (`run_traced(sink=)`): at each layer, while its tensors are alive,
    computes and keeps only what `methods` read afterwards (on `memo`, the streamed trace's Memo):

    - `layer_rows["alpha"]`: the target rows of α [B, H, K, n] (attention, per-head norm maps);
    - the norm engine's token and attention passes (`norms.stream_layer`): the target rows of the pair maps, the
      per-token quantities and what the per-run check needs, when a norm-engine method (or GlobEnc of a pre-LN
      model, which is N-Res there) is requested;
    - for a rollout, the rows of the layer's head-summed matrix that the backward row propagation multiplies by
      (`layer_fns`: Â for attention_rollout, ALTI, N-Enc / N-Res); for alti and globenc alone, their target rows
      (`layer_rows`).

    Causal LMs trace in row mode (`run_traced(qk_rows=True)`, `mixlens.rowattn`): no layer ever holds α [B, H, n, n];
    a rollout's layer rows are computed when the propagation reaches the layer, from what the stream keeps of it (q,
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
        self.names = frozenset(methods)
        pre_ln = adapter.family.pre_ln
        globenc = bool(self.names & {"globenc", "globenc_rollout"})
        self.memo = Memo(targets=rows, streamed=self.names, progress=on_layer)
        if any(get_method(m).engine for m in self.names) or (pre_ln and globenc):
            self.memo.norm_run = NormRun.start(adapter, mask, rows)
        self.every_row = pre_ln and "globenc_rollout" in self.names  # N-Res matrices for the GlobEnc rollout

    def keep(self, name: str, index: int, t: torch.Tensor) -> None:
        got = self.memo.layer_rows.setdefault(name, [])
        assert len(got) == index, f"layer {index} streamed out of order"
        got.append(t)

    def keep_fn(self, name: str, index: int, factory: LayerRowsFactory) -> None:
        got = self.memo.layer_fns.setdefault(name, [])
        assert len(got) == index, f"layer {index} streamed out of order"
        got.append(factory)

    def __call__(self, index: int, lt: LayerTrace) -> None:
        lay, mask, rows, names = self.adapter.layers[index], self.mask, self.rows, self.names
        row_mode = lt.qk is not None
        self.keep("alpha", index, lt.alpha_rows(rows))
        if self.memo.norm_run is not None:
            n_res = stream_layer(self.memo.norm_run, lt, index, self.every_row)
            if n_res is not None:
                self.keep_fn("globenc", index, _masked(n_res, mask))
        if "attention_rollout" in names:
            if row_mode:
                small = lt.for_rows()
                self.keep_fn(
                    "attention_rollout",
                    index,
                    lambda: lambda r: rollout.residual_of_rows(small.alpha_rows(r), mask, r),
                )
            else:
                self.keep_fn("attention_rollout", index, gathered(rollout.residual_rows(lt.alpha, mask, None)))
        if names & {"alti", "alti_rollout"}:
            pre_ln, causal = self.adapter.family.pre_ln, self.adapter.family.causal
            if "alti_rollout" in names and row_mode:
                small = lt.for_rows(alti=True)  # no x: its one use, the self pairs, is computed now
                diag = alti.self_contributions(lt, lay, pre_ln)
                self.keep_fn("alti", index, lambda: alti.layer_fn(small, lay, pre_ln, mask, causal, diag))
            else:
                fn = alti.layer_fn(lt, lay, pre_ln, mask, causal)
                if "alti_rollout" in names:
                    self.keep_fn("alti", index, gathered(fn(None)))
                else:
                    self.keep("alti", index, fn(rows))
        if names & {"globenc", "globenc_rollout"} and not self.adapter.family.pre_ln:
            fn = globenc.layer_fn(lt, lay, mask, index)
            if "globenc_rollout" in names:
                self.keep_fn("globenc", index, gathered(fn(None) * rollout.pair_mask(mask)[:, 0]))
            else:
                self.keep("globenc", index, fn(rows) * rollout.row_pair_mask(mask, rows))
        release(mask.shape[1])
        if self.on_layer is not None:
            self.on_layer("forward pass", index + 1, self.adapter.n_layers)


def _masked(rows_of: RowsFn, mask: torch.Tensor) -> LayerRowsFactory:
    """The factory of `rows_of`'s rows with padding pairs zeroed."""
    return lambda: lambda r: rows_of(r) * rollout.row_pair_mask(mask, r)


@torch.no_grad()
def stream_trace(
    adapter: Adapter,
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    methods: Sequence[str],
    targets: Targets,
    tokenizer: object | None = None,
    on_layer: LayerProgress | None = None,
) -> Trace:
    """One forward pass in target-row streaming mode for `methods` (all declaring `target_rows`) and `targets` (not
    all rows): each layer is consumed by a `LayerStream` as soon as it is complete and its α dropped, so the trace
    never holds the layers' n × n attention maps. `run_methods(trace, methods, targets=targets)` then finishes
    (rollout row propagation, the per-run check) from what the stream kept; other methods or targets are refused."""
    mask = inputs["attention_mask"].bool()
    rows = resolve_targets(targets, mask.sum(-1).tolist())
    if rows is None:
        raise MixlensError("streaming computes target rows: give targets other than 'all'")
    check_target_rows(methods)
    stream = LayerStream(adapter, mask, methods, rows.to(mask.device), on_layer)
    post_ln_globenc = not adapter.family.pre_ln and any(m in ("globenc", "globenc_rollout") for m in methods)
    # the sink is the only reader: FFN activations and layer outputs only for GlobEnc's LN2 (post-LN)
    trace = run_traced(
        adapter,
        model,
        inputs,
        ffn=post_ln_globenc,
        tokenizer=tokenizer,
        to_output=post_ln_globenc,
        sink=stream,
        qk_rows=adapter.family.causal,
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
    every method reads α only by rows (`Method.qk_rows`)."""
    return adapter.family.causal and bool(methods) and all(get_method(m).qk_rows for m in methods)


def needs_capture(methods: Sequence[str]) -> bool:
    """Whether `methods` read the captured forward pass (the methods declaring `inputs_only`, e.g. saliency or
    occlusion, run their own passes from the inputs alone)."""
    return any(not get_method(m).inputs_only for m in methods)
