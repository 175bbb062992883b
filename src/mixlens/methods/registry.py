"""Method registry: name → one pure function `fn(trace, *, heads=False, **options) -> Tensor | MethodOutput`.

The returned tensor has the axes `[batch, *dims]` (or `[batch, *head_dims]` with `heads=True`) in the
fixed order `[batch, layer, head, target, source]`; padded positions hold 0. A method may also return named
secondary outputs (`MethodOutput.extras`, declared with their axes in `register`). Options are declared with
types (`Option`) and checked here, in one place, before any model work: Python values by `Method.check`, the
CLI's `METHOD.KEY=VALUE` strings by `parse_option`. A method's declaration is everything the rest of mixlens knows
of it: its capabilities, its layer sink when it streams (`Stream`), its explain form (`explain_options`,
`Reference`) and display hints (`default_in`, `group`), and its reference card (`Card`: definition, cost, the
official implementation it equals and to what tolerance), from which `scripts/method_reference.py` writes
docs/reference/methods.md. The pipeline, explain, the views, the commands, the corpus runner and the reference page
read these and name no method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from mixlens.errors import MixlensError, did_you_mean
from mixlens.methods.memo import StreamLayer
from mixlens.targets import Request
from mixlens.trace import Trace

if TYPE_CHECKING:
    from mixlens.adapters import Family

LTS = ("layer", "target", "source")
LHTS = ("layer", "head", "target", "source")
OPTION_TYPES = (bool, int, float, str)


@dataclass
class MethodOutput:
    """What a method computed: `values` [batch, *dims] (padding 0) and named secondary outputs, each
    [batch, *axes declared in `register(extras=...)`] (e.g. integrated gradients' convergence delta [batch])."""

    values: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


MethodFn = Callable[..., torch.Tensor | MethodOutput]
F = TypeVar("F", bound=MethodFn)  # a method function keeps its own signature through `register`


@dataclass(frozen=True)
class Option:
    """One keyword option of a method: its type (bool, int, float or str), default and allowed values.

    `min`/`max` bound numbers (`open`: themselves excluded), `choices` lists the allowed strings, `optional` also
    allows None, `words` are strings allowed besides an int (e.g. `target='pred'`), `python_callable` also allows a
    callable (Python API), `per_input` also a tuple of values, one per input of the batch (Python API; e.g. each
    prompt's own target)."""

    name: str
    type: type
    default: object
    help: str = ""
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    optional: bool = False
    words: tuple[str, ...] = ()
    python_callable: bool = False
    per_input: bool = False
    open: bool = False  # min and max themselves excluded: (min, max)

    def __post_init__(self) -> None:
        if self.type not in OPTION_TYPES:
            raise TypeError(f"option '{self.name}': type must be one of bool, int, float, str")

    def expected(self) -> str:
        """What the option accepts, in words: 'an integer ≥ 2', 'one of l2, l1, sum', ..."""
        if self.choices is not None:
            kinds = [f"one of {', '.join(self.choices)}"]
        else:
            kinds = [{bool: "true or false", int: "an integer", float: "a number", str: "a string"}[self.type]]
        if self.type in (int, float) and self.min is not None and self.max is not None:
            low, high = "()" if self.open else "[]"
            kinds[0] += f" in {low}{_num(self.min)}, {_num(self.max)}{high}"
        elif self.type in (int, float) and self.min is not None:
            kinds[0] += f" ≥ {_num(self.min)}"
        elif self.type in (int, float) and self.max is not None:
            kinds[0] += f" ≤ {_num(self.max)}"
        kinds += [repr(w) for w in self.words]
        if self.optional:
            kinds.append("none")
        if self.python_callable:
            kinds.append("(Python) a callable")
        return " or ".join(kinds)

    def describe(self) -> str:
        """One line for `mixlens methods`: name, accepted values, default, help."""
        default = (
            "none"
            if self.default is None
            else str(self.default).lower()
            if self.type is bool
            else repr(self.default)
            if isinstance(self.default, str)
            else str(self.default)
        )
        return f"{self.name}: {self.expected()} (default {default})" + (f" — {self.help}" if self.help else "")

    def check(self, method: str, value: object) -> object:
        """A Python value, checked against the declaration (returned as given, ints as float for float options)."""
        if value is None and self.optional:
            return None
        if isinstance(value, str) and value in self.words:
            return value
        if callable(value) and self.python_callable and not isinstance(value, str):
            return value
        if self.python_callable and isinstance(value, Request):  # resolved once by explain (`targets.Request`)
            return value
        if self.per_input and isinstance(value, (tuple, list)):
            single = dataclasses.replace(self, per_input=False, optional=False, words=(), python_callable=False)
            return tuple(single.check(method, v) for v in value)
        ok = False
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, Integral) and not isinstance(value, bool)
            value = int(value) if ok else value  # type: ignore[call-overload]
        elif self.type is float:
            ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
            value = float(value) if ok else value  # type: ignore[arg-type]
        else:
            ok = isinstance(value, str) and (self.choices is None or value in self.choices)
        if ok and self.type in (int, float):
            ok = (self.min is None or value >= self.min) and (self.max is None or value <= self.max)  # type: ignore
            ok = ok and not (self.open and value in (self.min, self.max))
        if not ok:
            raise MixlensError(f"option {method}.{self.name} must be {self.expected()}, got {value!r}")
        return value

    def parse(self, method: str, raw: str) -> object:
        """A CLI string (`--option METHOD.KEY=VALUE`) converted to the declared type, then checked."""
        text = raw.strip()
        low = text.lower()
        value: object = text
        if self.optional and low in ("none", "null"):
            value = None
        elif text in self.words:
            value = text
        elif self.type is bool and low in ("true", "false"):
            value = low == "true"
        elif self.type is int:
            with contextlib.suppress(ValueError):
                value = int(text)
        elif self.type is float:
            with contextlib.suppress(ValueError):
                value = float(text)
        elif self.type is str and len(text) >= 2 and text[0] == text[-1] == '"':
            value = text[1:-1]  # a JSON-style quoted string
        return self.check(method, value)


TARGET_OPTIONS = (  # the request for the scalar being explained (`mixlens.targets`), shared by every method of one
    Option(
        "target",
        int,
        "pred",
        min=0,
        words=("pred",),
        python_callable=True,
        help="class index / token id of the explained scalar, 'pred' (the prediction) or (Python) f(output, inputs)",
        per_input=True,
    ),
    Option(
        "foil",
        int,
        None,
        min=0,
        optional=True,
        help="class / token id to contrast: logit(target) − logit(foil)",
        per_input=True,
    ),
    Option(
        "position",
        int,
        None,
        min=0,
        optional=True,
        help="token position of an LM target (default: the [MASK], or the last token of a causal LM)",
    ),
)


# The capabilities of a method that scores each source token for a target from the inputs alone (its own forward and
# backward passes): gradients, captum's perturbations, AttnLRP, value zeroing of a prediction.
TARGET_SCORES: dict[str, Any] = dict(dims=("source",), extra_passes=True, inputs_only=True, head="any", explains=True)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def any_family(family: Family) -> str | None:
    """Every supported family (the default `supports`)."""
    return None


def vector_block(family: Family) -> str | None:
    """Methods that decompose x + Attn(LN(x)) and x + FFN(LN(x)) (or their post-LN forms) as vectors: a norm on the
    attention output (Gemma's sandwich norms) is outside their math."""
    if family.ln_post is not None:
        return (
            f"its vector decomposition assumes x + Attn(LN(x)) and x + FFN(LN(x)), without the {family.name} family's "
            "norms on each branch's output"
        )
    return None


def dense_ffn(family: Family) -> str | None:
    """Methods that need the FFN as one set of linear maps and an activation per token (DecompX's linearisation,
    AttnLRP's rules): a routed mixture of experts (router softmax, top-k choice, a weighted sum of experts) is outside
    them."""
    if family.moe:
        return (
            f"it needs one dense FFN per token, and the {family.name} family routes each token through a mixture of "
            "experts (router weights times expert outputs)"
        )
    return None


def vector_dense(family: Family) -> str | None:
    """`vector_block` and `dense_ffn` together (DecompX carries vectors through both blocks)."""
    return vector_block(family) or dense_ffn(family)


@dataclass(frozen=True)
class Planned:
    """What a method's `precheck` sees before any weights load: the model config, the head that will load
    ('base', 'masked-lm', 'sequence-classification', 'causal-lm') and the inputs' token counts (tokenized on
    first call)."""

    config: Any
    head: str
    token_counts: Callable[[], list[int]]


def never(family: Family) -> bool:
    """A `Stream` predicate that holds for no family (the default of `norm_run` and `capture`)."""
    return False


@dataclass(frozen=True)
class Stream:
    """How a method computes its target rows layer by layer inside a streamed forward pass (`pipeline.stream_trace`):
    `sink(layer, whole)` is called at every layer with a `StreamLayer` and keeps what the method reads afterwards
    (`StreamLayer.keep` / `keep_fn` under `key`). Methods that read the same quantity name the same `key` and `sink`:
    it runs once per layer, with `whole` true when one of them needs rows at any position (a rollout's backward
    row propagation), not only the target rows. `norm_run(family)`: the stream also needs the norm engine's passes
    (`norms.stream_layer`), whose pair-map rows of every position reach the sink (`StreamLayer.pairs`) when `whole`;
    `capture(family)`: the pass also captures the FFN and runs to each layer's output (else it stops after the last
    attention block)."""

    key: str
    sink: Callable[[StreamLayer, bool], None]
    whole: bool = False
    norm_run: Callable[[Family], bool] = never
    capture: Callable[[Family], bool] = never


@dataclass(frozen=True)
class Reference:
    """This method, run with `options`, is explain's agreement reference, labelled `label` (e.g. grad_x_input with
    the L2 reduction: ‖∂g/∂e_j ⊙ e_j‖₂, the reference of the GlobEnc paper)."""

    label: str
    options: Mapping[str, object]


NONE = "none compared"  # `Card.official` of a method that was not compared with an official implementation
TRACED = "One traced forward pass (shared with the other methods of the run), no backward"  # a `Card.passes` phrase
ROLLOUT_MEMORY = "[L, n, n]; with --rows only the requested rows, streamed layer by layer ([L, t, n])"  # `Card.memory`
# of a rollout with a row mode


@dataclass(frozen=True)
class Card:
    """A method's reference card, the hand-written part of its entry in docs/reference/methods.md (axes, options,
    capabilities and refusals come from the rest of the declaration).

    `definition`: the math in one or two lines, after the paper's quantities; `passes`: its forward/backward passes;
    `memory`: the order of what it holds (e.g. [L, n, n]) and whether it has a row mode; `background`: (page, what it
    covers), the long-form page behind the card, relative to docs/reference/; `official`: the official
    implementation it was compared with, or `NONE`; `tolerance`: the tolerance that comparison measured and asserts
    and `check`: the test or benchmark that measures it (`path::name`), both set exactly when `official` is;
    `note`: an optional remark on the comparison (what was checked instead, why none exists). Only comparisons that
    were measured are named. `register` refuses a card that lacks any of these (`problems`).

    Notation: n tokens, L layers, H heads, d hidden size, t requested target rows, α^h_ij attention of head h,
    f^h(x) = (x W_V^h + b_V^h) W_O^h, t_ij = Σ_h α^h_ij f^h(x_j) + [i=j] x_i (attention plus residual), g_i a norm as
    the linear map at target i, g the explained scalar (a logit, a logit difference with a foil, or an encoder's
    pooled projection), e_j the word embedding of token j.
    """

    definition: str
    passes: str
    memory: str
    background: tuple[str, str]
    official: str = NONE
    tolerance: str = ""
    check: str = ""
    note: str = ""

    def problems(self) -> list[str]:
        """What the card lacks, in words (empty: complete): an empty required field, a tolerance or test without an
        official comparison, or an official comparison without its tolerance and test."""
        out = [f"empty {f}" for f in ("definition", "passes", "memory", "official") if not getattr(self, f).strip()]
        if len(self.background) != 2 or not all(part.strip() for part in self.background):
            out.append("empty background (page, what it covers)")
        if self.official == NONE:
            if self.tolerance.strip() or self.check.strip():
                out.append("a tolerance or test without an official comparison")
        elif not (self.tolerance.strip() and self.check.strip()):
            out.append("an official comparison without its tolerance and test")
        return out


VIEWS = ("analyze", "html", "plot", "ratio", "routes", "logit-layers", "saliency")  # where a method can be a default:
# analyze: the default method set (`Lens.analyze`, `mixlens analyze / report`); html: the report opens on the first
# present; plot: `mixlens plot`'s default method; ratio / routes / logit-layers: the method a figure of that view
# runs; saliency: `mixlens saliency`'s default kind


HEADS = (None, "any", "classifier", "causal")  # what `Method.head` may say
EXPLAINED_KINDS = ("classifier", "causal", "masked", "encoder")  # model kinds (`mixlens.targets.model_kind`)


@dataclass(frozen=True)
class Method:
    """A registered method: its function, output axes after batch, what the trace must hold, its options and how
    it streams; `REGISTRY` maps names to these (`register`)."""

    name: str
    fn: MethodFn
    dims: tuple[str, ...]  # axes after batch
    head_dims: tuple[str, ...] | None  # axes with heads=True (None: no per-head variant)
    needs_ffn: bool | Literal["update"]  # FFN activations in the trace, or "update": only the FFN's output
    extra_passes: bool  # runs the model again (value zeroing, gradients, ablations)
    summary: str
    card: Card  # its reference card (docs/reference/methods.md)
    options: tuple[Option, ...] = ()
    extras: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # secondary output name → axes after batch
    # Capabilities, declared once at registration (`register`); every other part of mixlens reads them from here.
    supports: Callable[[Family], str | None] = any_family  # None where its math covers the family, else why not
    head: str | None = None  # the model head it reads: None (none), 'any' (the target of any head: a class, an LM
    # token or an encoder's pooled embedding), 'classifier' or 'causal'
    explains: bool = False  # gives one score per source token for a target: ('source',) or ('class', 'source')
    # methods read their target; a map [layer, target, source] is read at its last layer's target row
    row_mode: bool = False  # computes only requested target rows, streamed layer by layer (`run_methods(rows=)`)
    inputs_only: bool = False  # runs its own passes from the inputs: reads nothing of the captured forward pass
    engine: bool = False  # runs the norm engine (`norms.block_norms`, with its per-run exactness check)
    slow: bool = False  # far slower than a forward pass: left out of default method sets, progress shown
    unnormalised: bool = False  # rows are plain products of unnormalised maps (their scale drifts with depth):
    # tables show them scaled to sum to 1
    precheck: Callable[[Planned], None] | None = None  # errors that need only the config and tokenizer
    qk_rows: bool = False  # reads α only by rows (`LayerTrace.alpha_rows` / `alpha_diagonal`): a causal LM's trace
    # for it keeps q, K and the softmax normaliser instead of α [B, H, n, n] (`mixlens.rowattn`)
    recommended: tuple[str, ...] = ()  # model kinds whose explanations it is recommended for (measured: docs/
    # evaluate.md); `explain` runs only these by default where a kind has any
    stream: Stream | None = None  # its layer sink in a streamed trace (methods with `row_mode` that keep more
    # than the target rows of α or what the norm engine streams)
    explain_options: Mapping[str, object] = field(default_factory=dict)  # options `explain` runs it with (its
    # signed form, e.g. reduction='sum')
    reference: Reference | None = None  # explain's agreement reference is this method with these options
    default_in: Mapping[str, int] = field(default_factory=dict)  # view (`VIEWS`) → its rank among that view's
    # defaults (`defaults(view)`, lowest first)
    group: str | None = None  # display group: 'mixing-ratio' (the methods the mixing-ratio table describes)
    backward: bool = False  # runs gradient passes (a backward through every layer: `memory.backward_bytes`)
    backward_rows: Callable[[int, int], int] | None = None  # rows of its largest backward for B inputs of n tokens
    # (memory estimates; default B)
    layered_rows: bool = False  # explaining an answer, its rows are added up layer by layer during the forward pass
    # (`alti_logit.LogitTerms`): no layer of the trace is kept

    def refusal(self, family: Family) -> str | None:
        """Why this method refuses the family (one line), or None."""
        why = self.supports(family)
        return None if why is None else f"method '{self.name}' does not support the {family.name} family: {why}"

    def reads(self, kind: str) -> bool:
        """Whether this method explains a target of a model of this kind ('classifier', 'causal', 'masked',
        'encoder'; see `mixlens.targets`)."""
        if not self.explains:
            return False
        return self.head in (None, "any") or self.head == kind

    @property
    def needs_output(self) -> bool:
        """Needs the whole forward pass (last FFN, logits): it captures the FFN, runs the model again, or reads the
        model head's output; otherwise a trace may stop after the last attention block."""
        return bool(self.needs_ffn) or self.extra_passes or self.reads_head

    @property
    def reads_head(self) -> bool:
        """Reads the model head's output from the trace (`Trace.logits`); otherwise a trace need not compute it."""
        return self.head is not None and not self.inputs_only

    def option(self, key: str) -> Option:
        """The declared option `key` (`MixlensError` naming the valid ones when there is none)."""
        for opt in self.options:
            if opt.name == key:
                return opt
        raise MixlensError(
            f"method '{self.name}' has no option '{key}'; options: {', '.join(o.name for o in self.options) or 'none'}"
        )

    def defaults(self) -> dict[str, object]:
        """Each option's default value, by name."""
        return {o.name: o.default for o in self.options}

    def check(self, options: Mapping[str, object] | None) -> dict[str, object]:
        """Options as given from Python, each checked against its declaration (`MixlensError` on the first bad
        one); unknown names are refused."""
        return {k: self.option(k).check(self.name, v) for k, v in (options or {}).items()}

    def run(self, trace: Trace, heads: bool = False, **options: object) -> MethodOutput:
        """Check the family and the options, run the function: values [batch, *dims_for(heads)] and extras."""
        why = self.refusal(trace.adapter.family)
        if why is not None:
            raise MixlensError(why)
        opts = self.check(options)
        out = self.fn(trace, heads=heads, **opts) if self.head_dims else self.fn(trace, **opts)
        out = out if isinstance(out, MethodOutput) else MethodOutput(out)
        for key, t in out.extras.items():
            axes = self.extras.get(key)
            if axes is None or t.dim() != len(axes) + 1 or t.shape[0] != out.values.shape[0]:
                raise RuntimeError(
                    f"method '{self.name}' returned extra '{key}' {tuple(t.shape)}, not declared "
                    f"as [batch, {', '.join(axes or ())}]"
                )
        return out

    def __call__(self, trace: Trace, heads: bool = False, **options: object) -> torch.Tensor:
        """The values alone (`run` also gives the extras)."""
        return self.run(trace, heads, **options).values

    def dims_for(self, heads: bool) -> tuple[str, ...]:
        """The output axes after batch: `head_dims` when `heads` and the method has a per-head variant, else `dims`."""
        return self.head_dims if heads and self.head_dims else self.dims


REGISTRY: dict[str, Method] = {}


def register(
    name: str,
    *,
    dims: tuple[str, ...] = LTS,
    head_dims: tuple[str, ...] | None = None,
    needs_ffn: bool | Literal["update"] = False,
    extra_passes: bool = False,
    options: tuple[Option, ...] = (),
    extras: Mapping[str, tuple[str, ...]] | None = None,
    supports: Callable[[Family], str | None] = any_family,
    head: str | None = None,
    explains: bool = False,
    row_mode: bool = False,
    inputs_only: bool = False,
    engine: bool = False,
    slow: bool = False,
    unnormalised: bool = False,
    precheck: Callable[[Planned], None] | None = None,
    qk_rows: bool = False,
    recommended: tuple[str, ...] = (),
    stream: Stream | None = None,
    explain_options: Mapping[str, object] | None = None,
    reference: Reference | None = None,
    default_in: Mapping[str, int] | None = None,
    group: str | None = None,
    card: Card | None = None,
    backward: bool = False,
    backward_rows: Callable[[int, int], int] | None = None,
    layered_rows: bool = False,
) -> Callable[[F], F]:
    """Register `fn` under `name`. `options` must declare exactly the function's keyword-only parameters (besides
    `heads`), with the same defaults; `extras` names the secondary outputs the function may return, with their
    axes after batch; `card` is its reference card (`Card`, required and complete). The rest declares what the
    method can do (see the fields of `Method`)."""

    def deco(fn: F) -> F:
        if name in REGISTRY:
            raise RuntimeError(f"method '{name}' registered twice")
        params = {
            k: p.default
            for k, p in inspect.signature(fn).parameters.items()
            if p.kind is p.KEYWORD_ONLY and k != "heads"
        }
        declared = {o.name: o.default for o in options}
        if params != declared:
            raise RuntimeError(f"method '{name}': options {declared} do not match the keyword parameters {params}")
        for key in extras or {}:
            if not key.isidentifier():
                raise RuntimeError(f"method '{name}': extra name '{key}' is not an identifier")
        if head not in HEADS:
            raise RuntimeError(f"method '{name}': head must be one of {HEADS}, got {head!r}")
        if recommended and not explains:
            raise RuntimeError(f"method '{name}' is recommended for explanations but explains no target")
        if explains and dims[-1] != "source":
            raise RuntimeError(f"method '{name}' explains a target but its last axis is not 'source': {dims}")
        if inputs_only and (needs_ffn or engine or row_mode):
            raise RuntimeError(f"method '{name}': a method that reads only the inputs cannot need the trace")
        if stream is not None and not row_mode:
            raise RuntimeError(f"method '{name}' streams its layers but does not declare row_mode")
        for key in (*(explain_options or {}), *(reference.options if reference else {})):
            if key not in declared:
                raise RuntimeError(f"method '{name}': explain option '{key}' is not one of its options")
        if not set(default_in or {}) <= set(VIEWS):
            raise RuntimeError(f"method '{name}': default_in views must be among {VIEWS}, got {dict(default_in or {})}")
        if card is None:
            raise RuntimeError(
                f"method '{name}' has no reference card: declare register(..., card=Card(definition=, passes=, "
                "memory=, background=, official=...)) (docs/contributing.md, how to add a method)"
            )
        lacks = card.problems()
        if row_mode and "no row mode" in card.memory:
            lacks.append("its memory says 'no row mode' but the method declares row_mode")
        if lacks:
            raise RuntimeError(f"method '{name}': its reference card is incomplete: {'; '.join(lacks)}")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        REGISTRY[name] = Method(
            name,
            fn,
            dims,
            head_dims,
            needs_ffn,
            extra_passes,
            summary,
            card,
            tuple(options),
            dict(extras or {}),
            supports,
            head,
            explains,
            row_mode,
            inputs_only,
            engine,
            slow,
            unnormalised,
            precheck,
            qk_rows,
            recommended,
            stream,
            dict(explain_options or {}),
            reference,
            dict(default_in or {}),
            group,
            backward,
            backward_rows,
            layered_rows,
        )
        return fn

    return deco


def get(name: str) -> Method:
    """The registered method `name` (`MixlensError` with a close match and the valid names when unknown)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise MixlensError(
            f"unknown method '{name}'{did_you_mean(name, names())}; valid methods: {', '.join(names())}"
        ) from None


def names() -> list[str]:
    """Every registered method name, in registry order."""
    return list(REGISTRY)


def explainers(kind: str, *, defaults: bool = False, recommended: bool = False) -> list[str]:
    """The methods that explain a target of a model of this kind (`Method.reads`), in registry order; `defaults`:
    without the slow ones (the default set of `explain` and `evaluate`); `recommended`: only those declared
    recommended for the kind (`Method.recommended`)."""
    return [
        m.name
        for m in REGISTRY.values()
        if m.reads(kind) and not (defaults and m.slow) and not (recommended and kind not in m.recommended)
    ]


def defaults(view: str) -> list[str]:
    """The methods that are a default of `view` (`VIEWS`; `Method.default_in`), by their declared rank, ties in
    registry order."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; views: {VIEWS}")
    found = [m for m in REGISTRY.values() if view in m.default_in]
    return [m.name for m in sorted(found, key=lambda m: m.default_in[view])]


def in_group(group: str) -> list[str]:
    """The methods of a display group (`Method.group`), in registry order."""
    return [m.name for m in REGISTRY.values() if m.group == group]


def reference() -> tuple[str, Reference]:
    """(method, its `Reference`): explain's agreement reference (one method declares it)."""
    found = [(m.name, m.reference) for m in REGISTRY.values() if m.reference is not None]
    if len(found) != 1:
        raise RuntimeError(f"exactly one method must declare explain's agreement reference, found {len(found)}")
    return found[0]


def refused_by(family: Family) -> list[str]:
    """The methods whose math does not cover this family's block (`Method.supports`)."""
    return [m.name for m in REGISTRY.values() if m.refusal(family) is not None]


def with_row_mode() -> list[str]:
    """The methods that compute requested rows only (`Method.row_mode`)."""
    return [m.name for m in REGISTRY.values() if m.row_mode]


def check_row_mode(methods: Sequence[str]) -> None:
    """Refuse, in one line, methods that cannot compute requested rows only (`run_methods(rows=)`)."""
    refused = [m for m in methods if not get(m).row_mode]
    if refused:
        raise MixlensError(
            f"method '{refused[0]}' cannot compute some rows only; with rows use {', '.join(with_row_mode())}"
        )


def check_options(
    methods: list[str] | tuple[str, ...], options: Mapping[str, Mapping[str, object]] | None
) -> dict[str, dict[str, object]]:
    """Options per method name (Python values) checked before any model work: every name must be among
    `methods`, every option declared and of the declared type."""
    out: dict[str, dict[str, object]] = {}
    for name, opts in (options or {}).items():
        if name not in methods:
            raise MixlensError(f"options given for '{name}', which is not among the methods")
        if not isinstance(opts, Mapping):
            raise MixlensError(f"options for '{name}' must be a mapping of option names to values")
        out[name] = get(name).check(opts)
    return out


def parse_option(method: str, key: str, raw: str) -> object:
    """One CLI `--option METHOD.KEY=VALUE`: VALUE converted to the option's declared type and checked."""
    return get(method).option(key).parse(method, raw)
