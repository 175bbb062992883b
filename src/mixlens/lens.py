"""The public entry point: `load` a model into a `Lens`, which runs the traced forward passes of its batches
(`batches`, `trace`) and assembles what the methods computed into results (`analyze`). Loading lives in
`mixlens.loading`, tokenising and batching in `mixlens.batching`."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixlens import methods as method_registry
from mixlens.adapters import Adapter
from mixlens.batching import Batch, Encoded, Text, Tokenized, check_max_length, check_texts, has_visible, text_of
from mixlens.errors import MixlensError
from mixlens.layouts import adapt
from mixlens.loading import (
    DEVICES,
    DTYPES,
    HEADS,
    RandomHeadError,
    check_dtype_on,
    checkpoint_dtype,
    default_model_path,
    dtype_name,
    head_for,
    pretrained,
    resolve_device,
    resolve_source,
)
from mixlens.pipeline import (
    NOT_GIVEN,
    LayerProgress,
    NotGiven,
    Rows,
    auto_rows,
    check_results,
    needs_capture,
    plan_batches,
    qk_trace,
    resolve_rows,
    run_methods,
    stream_trace,
    streams,
    trace_flags,
)
from mixlens.result import Analysis, Attribution, InputBiasRows, InputRows
from mixlens.trace import Edit, FfnCapture, Trace, run_traced
from mixlens.version import __version__

__all__ = [  # the loading and batching names lens.py always had
    "DEVICES",
    "DTYPES",
    "HEADS",
    "Batch",
    "Encoded",
    "RandomHeadError",
    "Text",
    "check_dtype_on",
    "check_max_length",
    "checkpoint_dtype",
    "default_model_path",
    "dtype_name",
    "has_visible",
    "head_for",
    "resolve_device",
    "resolve_source",
]

DEFAULT_METHODS = tuple(method_registry.registry.defaults("analyze"))  # the methods that declare it (registry)
CELLS_PER_INPUT = 64 * 64  # analyze's batches hold ≤ batch_size · 64² token pairs: a 512-token input runs alone


def load(
    model: str | Path | None = None,
    *,
    head: str | None = None,
    device: str | None = None,
    gguf_file: str | None = None,
    allow_random_head: bool = False,
    dtype: str | None = None,
    family: str | None = None,
) -> Lens:
    """Load a model for analysis: None = the bundled all-MiniLM-L6-v2, else a local dir or hub id.

    `gguf_file`: a GGUF file inside the directory `model`, de-quantised tensor by tensor into `dtype`
    (`mixlens.gguf_weights`; needs the `gguf` and `accelerate` packages). `head` picks the AutoModel class ('base',
    'masked-lm', 'sequence-classification', 'causal-lm'); by default it follows `config.architectures` (a GGUF
    decoder: its causal LM head), and where the checkpoint lacks that head's weights (e.g. a sentence-transformers
    folder whose config names a masked-LM class) the base model loads instead, with a warning: nothing random is
    loaded unasked. Always eager attention, eval mode. Weights missing from the checkpoint for a head asked for with
    `head` (a head transformers would initialise at random) are refused unless `allow_random_head`.

    `dtype`: the dtype the forward pass runs in: 'float32', 'bfloat16', 'float16', or 'auto' (the checkpoint's own,
    from its config; float32 when it names none); the decompositions accumulate in float32 either way, and their
    exactness checks allow the rounding of that dtype (docs/guides/your-model.md). `family`: read the model under that
    family's layout (`mixlens families`), checked on a probe input; by default its model type's, or for a model type
    outside the table the first known layout that passes the check (`mixlens.layouts`; a note on stderr says which).
    `device`: 'cpu', 'cuda', 'cuda:N' or 'auto' (cuda when available). None for either: float32 on the CPU. The
    commands pass their `--dtype`, `--device` and `--family` here the same way (`commands.options.Runtime`). A
    device this machine lacks, or a dtype it cannot run there, is a `MixlensError` before any weights load.
    """
    net, tok, name, torch_dtype, family = pretrained(
        model,
        head=head,
        device=device,
        gguf_file=gguf_file,
        allow_random_head=allow_random_head,
        dtype=dtype,
        family=family,
    )
    return Lens(net, tok, name=name, dtype=torch_dtype, family=family)


def input_limit(config: Any, tokenizer: Any) -> int:
    """The longest input a model of this config accepts with this tokenizer (position embeddings, or the tokenizer's
    limit); needs no weights (a corpus run's tokenizing stage reads it from the config alone)."""
    limits = [getattr(config, k, None) for k in ("max_position_embeddings", "n_positions")]
    if config.model_type in ("roberta", "xlm-roberta"):  # positions start after the padding index
        limits = [m - config.pad_token_id - 1 if m else m for m in limits]
    tok_max = getattr(tokenizer, "model_max_length", None)
    limits.append(tok_max if tok_max and tok_max < 1_000_000 else None)
    found = [m for m in limits if m]
    return min(found) if found else 512


class Lens:
    """A model ready for analysis. Build with `mixlens.load(...)` or `Lens(model, tokenizer)`."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str | None = None,
        dtype: str | torch.dtype | None = None,
        family: str | None = None,
    ):  # model: a transformers nn.Module
        """`dtype`: the dtype the forward pass runs in ('float32', 'bfloat16', 'float16', or 'auto': the model's own);
        None (default): float32, upcasting a model in another dtype with a warning. `family`: read the model under
        that family's layout (checked on a probe input, `mixlens.layouts`); by default its model type's, or for a
        model type outside the table the first known layout that passes (`family_note` and stderr say which)."""
        own = next(model.parameters()).dtype
        if dtype is None:
            if own != torch.float32:
                warnings.warn(
                    f"mixlens analyses in fp32 unless asked: upcasting this {own} model "
                    "(Lens(..., dtype='auto') keeps a bfloat16 or float16 model's own dtype)",
                    stacklevel=2,
                )
                model = model.float()
        else:
            name_ = dtype_name(dtype)
            want = DTYPES[dtype_name(own)] if name_ == "auto" else DTYPES[name_]
            if own != want:
                model = model.to(want)
        if getattr(model.config, "_attn_implementation", "eager") != "eager":
            model.set_attn_implementation("eager")
        if getattr(model.config, "_experts_implementation", "eager") != "eager":  # a mixture of experts: the expert
            model.set_experts_implementation("eager")  # loop, which forward-mode AD (`hta`) can differentiate
        self.model: Any = model.eval()  # a transformers model: its attributes (config, heads) are dynamic
        self.tokenizer = tokenizer
        self.adapter: Adapter
        self.adapter, self.family_note = adapt(model, tokenizer, family)
        if self.family_note:
            print(f"note: {self.family_note}", file=sys.stderr)
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        if tokenizer.pad_token_id is None:  # decoders: pad with eos, masked anyway
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the forward pass runs in (the decompositions accumulate in float32)."""
        return next(self.model.parameters()).dtype

    @property
    def max_length(self) -> int:
        """The longest input the model accepts (position embeddings, or the tokenizer's limit)."""
        return input_limit(self.model.config, self.tokenizer)

    def special_roles(self, ids: Iterable[int]) -> list[str | None]:
        """Role of each token id ('cls', 'sep', 'bos', 'eos', 'pad', 'mask', 'unk') or None; by id, never
        by string. Where two roles share an id (GPT-2: bos = eos) the first listed wins."""
        t = self.tokenizer
        by_id: dict[int, str] = {}
        for role in ("cls", "sep", "bos", "eos", "pad", "mask", "unk"):
            tid = getattr(t, f"{role}_token_id", None)
            if tid is not None:
                by_id.setdefault(tid, role)
        return [by_id.get(int(i)) for i in ids]

    def limit(self, max_length: int | None = None) -> int:
        """The token limit of a call: `max_length` (at most the model's), else the model's."""
        if max_length is not None and max_length < 1:
            raise MixlensError(f"max_length must be at least 1 (got {max_length})")
        return self.max_length if max_length is None else min(max_length, self.max_length)

    def encode(
        self, texts: Sequence[Text | list[str]], max_length: int | None = None, truncate: bool = True
    ) -> Encoded:
        """Tokenize a batch once (right padding). Inputs are texts, `(text, text)` pairs, or pre-split words
        (`list[str]`, e.g. a UD sentence; `words` then maps tokens to these words). Over-long inputs are
        truncated, or refused if not `truncate`; a limit below what the special tokens need is refused."""
        texts = check_texts(texts)
        return Tokenized(self.tokenizer, texts, self.limit(max_length), truncate, self.max_length).batch(
            self.tokenizer, self.device, range(len(texts))
        )

    def encode_ids(self, ids: Sequence[Sequence[int]]) -> Encoded:
        """A right-padded batch of inputs given as token ids (single segments; no truncation)."""
        if not ids or any(not len(x) for x in ids):
            raise MixlensError("every input needs at least one token")
        return Tokenized.from_ids(ids).batch(self.tokenizer, self.device, range(len(ids)))

    def batches(
        self,
        texts: Sequence[Text | list[str]],
        batch_size: int = 32,
        max_length: int | None = None,
        *,
        truncate: bool = True,
        order: str = "input",
        max_tokens: int | None = None,
        max_cells: int | None = None,
        trace: bool | Sequence[str] = False,
        rows: Rows = None,
        output: bool = False,
        on_layer: LayerProgress | None = None,
        on_lengths: Callable[[Sequence[int]], object] | None = None,
    ) -> Iterator[Batch]:
        """Batches of `texts`, each tokenized once: `order='input'` cuts the inputs in order into batches of
        `batch_size`; `order='length'` tokenizes all inputs first and packs them longest first into batches of
        ≤ `batch_size` inputs, ≤ `max_tokens` padded tokens and ≤ `max_cells` padded token pairs (inputs · n², which
        bounds the [.., n, n] maps); `Batch.index` says where each input came from.
        `trace`: False (no forward pass), True (a full trace) or registry method names (a trace with the FFN
        activations / whole forward pass those methods need; none, only the inputs, when no method reads it).
        `rows` with method names (all declaring `row_mode`): row streaming (`pipeline.stream_trace`).
        `output`: a captured forward pass runs to the model's output (`Trace.logits` / `Trace.hidden`), which is
        what explaining a prediction reads. `on_layer(phase, done, total)`: progress in layers of a streamed trace (long
        inputs; `pipeline.LayerProgress`). `on_lengths(lengths)`: called with the inputs' token counts before the
        first batch runs (`order='length'`; e.g. a memory check)."""
        texts = check_texts(texts)
        if order not in ("input", "length"):
            raise MixlensError(f"unknown batch order '{order}'; valid: input, length")
        if min([batch_size, *(x for x in (max_tokens, max_cells) if x is not None)]) < 1:
            raise MixlensError(
                f"batch_size, max_tokens and max_cells must be at least 1 (got {batch_size}, {max_tokens}, {max_cells})"
            )
        limit = self.limit(max_length)
        plan: Iterable[tuple[Tokenized | None, Sequence[int], Sequence[int] | None]]
        if order == "length":
            tokenized = Tokenized(self.tokenizer, texts, limit, truncate, self.max_length)
            if on_lengths is not None:
                on_lengths(tokenized.lengths)
            plan = [
                (tokenized, index, index)
                for index in plan_batches(tokenized.lengths, batch_size, max_tokens, max_cells)
            ]
        else:
            plan = ((None, range(s, min(s + batch_size, len(texts))), None) for s in range(0, len(texts), batch_size))
        for tok, index, local in plan:
            if tok is None or local is None:  # input order: tokenize each batch when it is reached (streams)
                tok = Tokenized(self.tokenizer, [texts[b] for b in index], limit, truncate, self.max_length)
                local = range(len(index))
            enc = tok.batch(self.tokenizer, self.device, local)
            traced = None if trace is False else self.trace_for(enc, trace, rows, output, on_layer)
            yield Batch(list(index), enc, traced)

    def trace_for(
        self,
        enc: Encoded,
        trace: bool | Sequence[str] = True,
        rows: Rows = None,
        output: bool = False,
        on_layer: LayerProgress | None = None,
        logit_at: torch.Tensor | None = None,
    ) -> Trace:
        """The trace a batch needs (see `batches`): True a full one; for method names, one with what they read
        (FFN activations, the whole forward pass, or `output`), row streaming for `rows`, or the inputs
        alone, with no forward pass, when no method reads the captured pass. `logit_at` [K]: the logits of those
        positions only (`run_traced`)."""
        ffn, to_output = (False, True) if isinstance(trace, bool) else trace_flags(trace)
        if trace is not True and (isinstance(trace, bool) or not needs_capture(trace)):
            return Trace(self.adapter, self.model, enc.inputs, [], None, self.tokenizer)  # inputs only, no forward
        if not isinstance(trace, bool) and streams(trace, rows):
            return stream_trace(
                self.adapter, self.model, enc.inputs, trace, rows, self.tokenizer, on_layer, output, logit_at
            )
        qk_rows = not isinstance(trace, bool) and qk_trace(trace, self.adapter)
        head = output or isinstance(trace, bool) or any(method_registry.get(m).reads_head for m in trace)
        return self.trace(enc, ffn=ffn, to_output=to_output or output, qk_rows=qk_rows, head=head, logit_at=logit_at)

    @torch.no_grad()
    def trace(
        self,
        enc: Encoded | Sequence[Text],
        edits: dict[str, Edit] | None = None,
        ffn: FfnCapture = False,
        to_output: bool = True,
        qk_rows: bool = False,
        head: bool = True,
        logit_at: torch.Tensor | None = None,
    ) -> Trace:
        """One forward pass with capture hooks (and optional attention edits); `to_output=False` stops after the last
        attention block; `qk_rows`: each layer keeps q and K instead of α; `head=False`: the pass runs the base model
        only, without the model head (no logits: a causal LM's [B, n, V] are not computed; see `run_traced`)."""
        if not isinstance(enc, Encoded):
            enc = self.encode(enc)
        return run_traced(
            self.adapter,
            self.model,
            enc.inputs,
            edits=edits,
            ffn=ffn,
            tokenizer=self.tokenizer,
            to_output=to_output,
            qk_rows=qk_rows,
            head=head,
            logit_at=logit_at,
        )

    def analyze(
        self,
        texts: Text | Sequence[Text | list[str]],
        methods: Sequence[str] | None = None,
        *,
        heads: bool = False,
        batch_size: int = 32,
        max_length: int | None = None,
        truncate: bool = True,
        options: dict[str, dict[str, object]] | None = None,
        on_batch: Callable[[int], None] | None = None,
        rows: Rows = "auto",
        on_layer: LayerProgress | None = None,
        targets: Rows | NotGiven = NOT_GIVEN,
    ) -> Analysis:
        """Run `methods` (registry names) on `texts`; returns an `Analysis` with values
        `[batch, layer, (head), target, source]` (in input order), and the mixing ratios and reconstruction
        self-check when a method used the norm engine. Inputs are batched by token length and every result is
        stored per batch, padded only to its batch's longest input (batches hold at most `batch_size` · 64² token
        pairs, so long inputs run in small batches). `rows`, the positions on the target axis to compute ("last",
        positions, negative from each input's end; None/"all": every row; "auto", the default: `auto_rows`, "last"
        for a causal LM with an input over `pipeline.LONG_CAUSAL` tokens, else every row): only those rows,
        `[batch, layer, (head), K, source]`, their positions in each `Attribution.rows` (memory per input:
        layers · n · K instead of layers · n²). `targets`: deprecated name of `rows`.
        `on_batch(k)`: k inputs done; `on_layer(phase, done, total)`: layers done of a row batch's forward
        pass and row propagation (progress within one long input)."""
        if not isinstance(targets, NotGiven):
            warnings.warn("Lens.analyze(targets=) is deprecated: use rows=", DeprecationWarning, stacklevel=2)
            rows = targets
        texts = check_texts([texts] if isinstance(texts, (str, tuple)) else list(texts))
        if isinstance(rows, str) and rows == "auto":
            rows = self.auto_rows(texts, max_length, truncate)
        names = list(dict.fromkeys(methods if methods is not None else method_registry.registry.defaults("analyze")))
        specs = [method_registry.get(m) for m in names]
        options = method_registry.check_options(names, options)

        def fits(lengths: Sequence[int]) -> None:  # every row: the longest input's maps must fit, said before any pass
            if rows is None or rows == "all":
                check_results(self.adapter, specs, heads, (1, max(lengths)), None, self.device)

        n_in = len(texts)
        parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {s.name: [] for s in specs}
        extras: dict[str, dict[str, list[tuple[np.ndarray, np.ndarray]]]] = {s.name: {} for s in specs}
        ratios: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        scales: list[tuple[np.ndarray, np.ndarray]] = []  # s_i per batch, for the bias (built when read)
        bias_terms: np.ndarray | None = None
        errors: np.ndarray | None = None
        shares: np.ndarray | None = None
        tokens: list[list[str]] = [[] for _ in range(n_in)]
        words: list[list[int | None]] = [[] for _ in range(n_in)]
        positions: list[list[int]] = [[] for _ in range(n_in)]
        batch_size = max(1, int(batch_size))
        for batch in self.batches(
            texts,
            batch_size,
            max_length,
            truncate=truncate,
            order="length",
            max_cells=batch_size * CELLS_PER_INPUT,
            trace=names,
            rows=rows,
            on_layer=on_layer,
            on_lengths=fits,
        ):
            enc, idx = batch.enc, np.asarray(batch.index)
            for k, n in enumerate(enc.truncated):
                if n:
                    print(
                        f"warning: input {batch.index[k] + 1} truncated from {n} to {len(enc.tokens[k])} tokens",
                        file=sys.stderr,
                    )
            assert batch.trace is not None  # trace=names
            step = run_methods(batch.trace, names, heads=heads, options=options, rows=rows)
            where = resolve_rows(rows, batch.trace.lengths)
            for k, b in enumerate(batch.index):
                positions[b] = [] if where is None else where[k].tolist()
            for name, v in step.values.items():
                parts[name].append((idx, _host(v)))
                for key, e in step.extras[name].items():
                    extras[name].setdefault(key, []).append((idx, _host(e)))
            if step.norms is not None:
                for view, r in step.norms.ratio.items():
                    ratios.setdefault(view, []).append((idx, r.cpu().numpy()))
                errors = np.zeros(n_in, np.float32) if errors is None else errors
                errors[idx] = step.norms.error.amax(1).cpu().numpy()
                if step.norms.error_share is not None:
                    shares = np.zeros(n_in, np.float32) if shares is None else shares
                    shares[idx] = step.norms.error_share.amax(1).cpu().numpy()
                scales.append((idx, step.norms.scale.cpu().numpy()))
                bias_terms = step.norms.bias_terms.cpu().numpy()
            for k, b in enumerate(batch.index):
                tokens[b], words[b] = enc.tokens[k], enc.words[k]
            if on_batch:
                on_batch(len(batch.index))
        lengths = [len(t) for t in tokens]
        attributions = {
            s.name: Attribution(
                InputRows(parts[s.name], s.dims_for(heads), lengths),
                s.dims_for(heads),
                tokens,
                s.name,
                self.name,
                {"heads": heads, **options.get(s.name, {})},
                words,
                {k: InputRows(p, s.extras[k], lengths) for k, p in extras[s.name].items()},
                None if rows is None or rows == "all" else positions,
            )
            for s in specs
        }
        return Analysis(
            model=self.name,
            version=__version__,
            texts=[text_of(t) for t in texts],
            tokens=tokens,
            attributions=attributions,
            ratios={v: InputRows(p, ("layer", "target"), lengths) for v, p in ratios.items()},
            reconstruction_error=errors,
            error_share=shares,
            bias=None
            if bias_terms is None
            else InputBiasRows(InputRows(scales, ("layer", "target"), lengths), bias_terms),
        )

    def auto_rows(self, texts: Sequence[Text | list[str]], max_length: int | None = None, truncate: bool = True) -> str:
        """The rows `analyze` computes by default for `texts` (`pipeline.auto_rows`: "last" for a causal
        LM with an input over `pipeline.LONG_CAUSAL` tokens, else "all"); only a causal LM's inputs are tokenized."""
        if not self.adapter.family.causal:
            return "all"
        tokenized = Tokenized(self.tokenizer, check_texts(texts), self.limit(max_length), truncate, self.max_length)
        return auto_rows(tokenized.lengths, causal=True)

    def explain(self, texts: str | Sequence[str], methods: Sequence[str] | None = None, **kwargs: Any) -> Any:
        """Deprecated: `mixlens.explain.explain(lens, texts, methods, ...)` (explain is a function on a lens)."""
        warnings.warn(
            "Lens.explain is deprecated: use mixlens.explain.explain(lens, texts, ...)",
            DeprecationWarning,
            stacklevel=2,
        )
        from mixlens.explain import explain  # the one import upwards: this deprecated alias (docs/DESIGN.md §5)

        return explain(self, texts, methods, **kwargs)


def _host(t: torch.Tensor) -> np.ndarray:
    """A result as a numpy array (float32 for a bfloat16 / float16 tensor, which numpy cannot hold)."""
    t = t.detach()
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).cpu().numpy()
