"""The scalar being explained: one notion for every method that explains a prediction.

A *target* is resolved per input from the model's own output on the real input:

- sequence classifiers: a class (default: the predicted one; an index or a label name of `config.id2label`);
- causal LMs: the next token after the text, read at the last real token (default: the model's top token; or a
  given token); masked LMs: a token at a position (default: the first [MASK]);
- sentence encoders (base models, pooled as their sentence-transformers config says, mean by default): the
  pooled embedding e(x);
- optionally contrasted with a *foil* class or token: logit(target) − logit(foil);
- (Python) any function `f(model_output, inputs) -> [B]`.

Two scalars per target, both functions of one model output (`score`):
- the *attribution score* g(x) that attribution methods explain: the target logit (minus the foil logit), or for
  encoders the projection e(x)·e₀/‖e₀‖² on the unperturbed embedding e₀ (the cosine's gradient vanishes at x,
  its maximum);
- the *faithfulness score* f(x) of `mixlens evaluate`: the target's probability (softmax over classes or over the
  vocabulary at the target position), or for encoders cos(e(x), e₀).

Registry methods take the request as the options `target`, `foil` and `position` (`registry.TARGET_OPTIONS`);
`readout` turns a request and one unperturbed output into a `Readout`, the per-input tensors every method reads g
from. `explain` resolves its request once per batch into a `Request` (frozen ids: per input the target and foil ids
and the position read, and whether g is the log-probability) and hands that to the methods as their `target`
option: `readout` then reads it as given and resolves nothing again.

Answers (`explain(..., answer=)`, multi-token targets): row a of an answer explains answer token a read at the
position before it, in one forward pass of prompt + answer (teacher forcing). There g is the token's
log-probability log p(a | prompt, answer[:a]) (`Request.logprob`) for the methods that read g from the model's output;
the methods that decompose a logit (`logit_attn`, `alti_logit`, `decompx_logit`, `attnlrp`) explain the token's
logit (docs/reference/answers.md).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from mixlens.errors import MixlensError

KINDS = ("classifier", "causal", "masked", "encoder")  # model kinds, by the head class
KIND_NAMES = {
    "classifier": "a sequence classifier",
    "causal": "a causal LM",
    "masked": "a masked LM",
    "encoder": "a base encoder",
}
EXPLAINS = {"classifier": "class", "causal": "token", "masked": "token", "encoder": "embedding"}  # kind → target
Spec = int | str | Callable[..., torch.Tensor]  # 'pred', a class index / label, a token id / text, or a callable


@dataclass(frozen=True)
class Target:
    """One input's target: kind 'class', 'token' or 'embedding'; index = class index or token id (−1 for an
    embedding); foil = contrast class/token id or None; label = human-readable name."""

    kind: str
    index: int
    label: str
    foil: int | None = None
    foil_label: str | None = None

    def to_json(self, score: float) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind, "label": self.label, "score": score}
        if self.foil is not None:
            out["foil"] = self.foil_label
        return out


def model_kind(model: torch.nn.Module) -> str:
    """'classifier', 'causal', 'masked' or 'encoder' from the model's head class."""
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        return "classifier"
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal"
    if name.endswith("ForMaskedLM"):
        return "masked"
    if name.endswith("Model"):
        return "encoder"
    raise MixlensError(
        f"mixlens explains sequence classifiers, language models and base encoders, not {name}; "
        "load the model with head='sequence-classification', 'causal-lm', 'masked-lm' or 'base'"
    )


def pooling(model: torch.nn.Module) -> str:
    """'cls' or 'mean': the sentence-transformers pooling of a base encoder (mean when not configured)."""
    cfg = Path(str(getattr(model.config, "_name_or_path", ""))) / "1_Pooling" / "config.json"
    if cfg.is_file():
        from mixlens.jsonio import read

        modes = read(cfg)  # a malformed file is one line naming it, not a silent default
        if modes.get("pooling_mode_cls_token") and not modes.get("pooling_mode_mean_tokens"):
            return "cls"
    return "mean"


def pooled(hidden: torch.Tensor, mask: torch.Tensor, pool: str) -> torch.Tensor:
    """hidden [B, n, d], mask [B, n] → [B, d] (mean over real tokens, or the first token)."""
    if pool == "cls":
        return hidden[:, 0]
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1)


def positions(kind: str, inputs: dict[str, torch.Tensor], tokenizer: Any, position: int | None = None) -> torch.Tensor:
    """The position each input's target is read at [B]: `position` if given, else (masked LMs) the first [MASK],
    (causal LMs) the last real token; 0 for classifiers and encoders (unused)."""
    mask = inputs["attention_mask"].bool()
    lengths = mask.sum(-1).cpu()
    if position is not None:
        if position >= int(lengths.min()):
            raise MixlensError(f"position must be a token index below {int(lengths.min())}, got {position!r}")
        return torch.full((mask.shape[0],), position, dtype=torch.long)
    if kind == "causal":
        return lengths - 1
    if kind == "masked":
        mask_id = getattr(tokenizer, "mask_token_id", None)
        hits = inputs["input_ids"].cpu() == mask_id if mask_id is not None else torch.zeros_like(mask.cpu())
        if bool(hits.any(-1).all()):
            return hits.int().argmax(-1)
        raise MixlensError("no [MASK] token in every input; mark one with the tokenizer's mask token or give position")
    return torch.zeros(mask.shape[0], dtype=torch.long)


@dataclass(frozen=True)
class Request:
    """The scalar being explained, resolved for one batch: per input the target's class / token id, the foil's id
    (−1: none) and the position an LM target is read at (None: the kind's default, `positions`); `logprob`: g is the
    target's log-probability log softmax(logits)[target] (minus the foil's) instead of its logit. Hashable, so
    methods key their caches on it; methods read it as given (`readout`), never resolve it again."""

    index: tuple[int, ...]
    foil: tuple[int, ...]
    position: tuple[int, ...] | None = None
    logprob: bool = False

    def __post_init__(self) -> None:
        n = len(self.index)
        if len(self.foil) != n or (self.position is not None and len(self.position) != n):
            raise ValueError("a Request names one index, foil and position per input")

    def select(self, rows: list[int]) -> Request:
        """The request of some inputs of the batch."""
        pos = None if self.position is None else tuple(self.position[r] for r in rows)
        return Request(tuple(self.index[r] for r in rows), tuple(self.foil[r] for r in rows), pos, self.logprob)


@dataclass
class Readout:
    """Reads g (attribution score) and f (faithfulness score) from a model output, for a batch of targets.

    index [B] class/token ids (−1: embedding), foil [B] (−1: none), position [B] the position an LM target is
    read at, e0 [B, d] unperturbed pooled embeddings (encoders), fn a Python target function (then g = f = fn)."""

    kind: str
    pool: str
    index: torch.Tensor
    foil: torch.Tensor
    position: torch.Tensor
    e0: torch.Tensor | None = None
    fn: Callable[..., torch.Tensor] | None = None
    logprob: bool = False  # g is the target's log-probability (answers, multi-token targets), not its logit

    def request(self) -> Request | None:
        """This readout as a `Request` the methods take as given; None for encoders and Python target functions."""
        if self.fn is not None or self.kind == "encoder":
            return None
        return Request(
            tuple(int(i) for i in self.index),
            tuple(int(f) for f in self.foil),
            tuple(int(p) for p in self.position),
            self.logprob,
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Per-input tensors that travel with captum's batch expansion: (index, foil, position, e0)."""
        e0 = self.e0 if self.e0 is not None else torch.zeros(self.index.shape[0], 1)
        return self.index, self.foil, self.position, e0

    def select(self, rows: slice | torch.Tensor) -> Readout:
        e0 = self.e0[rows] if self.e0 is not None else None
        return Readout(
            self.kind, self.pool, self.index[rows], self.foil[rows], self.position[rows], e0, self.fn, self.logprob
        )

    def g(self, out: Any, inputs: dict[str, torch.Tensor], *tensors: torch.Tensor, row_at: torch.Tensor | None = None):
        """The attribution score g [B] of a model output; `tensors` = `self.tensors()` (or captum's expansion of
        them). `row_at` [B]: where each row's target position sits on the logits' position axis, when the forward
        computed only some positions (`logits_to_keep`)."""
        if self.fn is not None:
            return self.fn(out, inputs)
        index, foil, position, e0 = tensors or self.tensors()
        mask = inputs["attention_mask"]
        return score(self.kind, self.pool, out, mask, index, foil, position, e0, row_at, self.logprob)[0]


def logit_rows(kind: str, logits: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The logits a target reads [B, classes | vocabulary]: a classifier's, or an LM's at each row's `position`."""
    if kind == "classifier":
        return logits
    return logits[torch.arange(position.shape[0], device=logits.device), position.to(logits.device)]


def score(
    kind: str,
    pool: str,
    out: Any,
    mask: torch.Tensor,
    index: torch.Tensor,
    foil: torch.Tensor,
    position: torch.Tensor,
    e0: torch.Tensor,
    row_at: torch.Tensor | None = None,
    logprob: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [B], f [B]) of one model output; see the module docstring. `logprob`: g is read from the log-softmax of
    the logits (log p(target) − log p(foil)) instead of the logits."""
    if kind == "encoder":
        e = pooled(out.last_hidden_state, mask, pool)
        g = (e * e0).sum(-1) / (e0 * e0).sum(-1).clamp_min(torch.finfo(e0.dtype).tiny)
        return g, F.cosine_similarity(e, e0, dim=-1)
    rows = logit_rows(kind, out.logits, position if row_at is None else row_at)
    idx = index.to(rows.device)[:, None]
    if logprob:
        rows = rows.float().log_softmax(-1)
    g = rows.gather(1, idx)[:, 0]
    has_foil = foil.to(rows.device) >= 0
    g = g - torch.where(has_foil, rows.gather(1, foil.clamp_min(0).to(rows.device)[:, None])[:, 0], 0.0)
    return g, (rows.exp() if logprob else rows.float().softmax(-1)).gather(1, idx)[:, 0]


def _digits(spec: str) -> bool:
    """An ASCII integer (unicode digits such as '²' are not class indices)."""
    text = spec.strip()
    body = text[1:] if text[:1] == "-" else text
    return body.isascii() and body.isdigit()


def class_index(config: Any, spec: str | int) -> int:
    """A class of a classifier from an index or a label name of `config.id2label`."""
    labels = {int(k): str(v) for k, v in (config.id2label or {}).items()}
    n = config.num_labels
    if (isinstance(spec, int) and not isinstance(spec, bool)) or (isinstance(spec, str) and _digits(spec)):
        i = int(spec)
        if not 0 <= i < n:
            raise MixlensError(f"class {i} out of range; the model has {n} classes")
        return i
    for i, name in labels.items():
        if unicodedata.normalize("NFC", name.lower()) == unicodedata.normalize("NFC", str(spec).strip().lower()):
            return i
    raise MixlensError(f"the model has no label '{spec}'; labels: {', '.join(labels[i] for i in sorted(labels))}")


def token_id(tokenizer: Any, spec: str | int) -> int:
    """A single vocabulary token from an id, a vocabulary entry, or a text that tokenizes to one token."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        if not 0 <= spec < len(tokenizer):
            raise MixlensError(f"token id {spec} out of range; the vocabulary has {len(tokenizer)} entries")
        return spec
    vocab = tokenizer.get_vocab()
    if spec in vocab:
        return vocab[spec]
    ids = tokenizer(spec, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise MixlensError(f"'{spec}' is {len(ids)} tokens for this tokenizer ({pieces}); give a single token")
    return ids[0]


def token_label(tokenizer: Any, tid: int) -> str:
    """A token as readable text: the decoded string (byte-level 'Ġ' shown as a space), else the vocabulary entry."""
    text = tokenizer.decode([int(tid)])
    return text if text.strip() else tokenizer.convert_ids_to_tokens(int(tid))


def resolve_index(kind: str, config: Any, tokenizer: Any, spec: str | int) -> int:
    """A class index (classifiers) or token id (LMs) from what a user typed; encoders have no such target."""
    if kind == "encoder":
        raise MixlensError("a sentence encoder has one target, its pooled embedding: drop --target/--foil")
    return class_index(config, spec) if kind == "classifier" else token_id(tokenizer, spec)


def _per_input(kind: str, config: Any, tokenizer: Any, specs: Any, bsz: int, what: str) -> torch.Tensor:
    """Per-input targets (or foils) given as a tuple, one class / token per input of the batch → ids [B]."""
    if len(specs) != bsz:
        raise MixlensError(f"{len(specs)} {what}s given for a batch of {bsz} inputs; give one per input")
    return torch.tensor([resolve_index(kind, config, tokenizer, s) for s in specs], dtype=torch.long)


def readout(
    model: Any,
    tokenizer: Any,
    out: Any,
    inputs: dict[str, torch.Tensor],
    target: Spec | tuple[int | str, ...] | Request | None = "pred",
    foil: str | int | tuple[int | str, ...] | None = None,
    position: int | None = None,
    row_at: torch.Tensor | None = None,
) -> tuple[list[Target], Readout]:
    """The targets of a batch from its unperturbed model output `out` (no extra forward pass): per input the class
    or token `target` names ('pred' or None: the model's top one), contrasted with `foil` when given; a tuple
    names one target (foil) per input. `row_at` [B]:
    where each target position sits on the logits' position axis when the forward computed only some positions.
    A `Request` (resolved by `explain`) is read as given: nothing is resolved again, and `foil` / `position` must
    be None (the request holds them)."""
    kind = model_kind(model)
    mask = inputs["attention_mask"]
    bsz = mask.shape[0]
    if isinstance(target, Request):
        return of_request(kind, model, tokenizer, inputs, target, foil, position)
    none = torch.full((bsz,), -1)
    pos = positions(kind, inputs, tokenizer, position)
    if callable(target) and not isinstance(target, str):
        if foil is not None:
            raise MixlensError("a Python target function is its own scalar: drop the foil")
        return [Target("custom", -1, getattr(target, "__name__", "f")) for _ in range(bsz)], Readout(
            kind, "", none, none.clone(), pos, None, target
        )
    if kind == "encoder":
        if target not in (None, "pred") or foil is not None:
            raise MixlensError("a sentence encoder has one target, its pooled embedding: drop --target/--foil")
        pool = pooling(model)
        e0 = pooled(out.last_hidden_state, mask, pool).detach()
        return [Target("embedding", -1, f"{pool}-pooled embedding") for _ in range(bsz)], Readout(
            kind, pool, none, none.clone(), pos, e0
        )
    if getattr(out, "logits", None) is None:
        raise MixlensError(
            "this model has no output head; load it with one (e.g. --model-head sequence-classification) "
            "or pass a Python callable as target"
        )
    rows = logit_rows(kind, out.logits, pos if row_at is None else row_at)
    if isinstance(target, (tuple, list)):
        idx = _per_input(kind, model.config, tokenizer, target, bsz, "target")
    elif target in (None, "pred"):
        idx = rows.argmax(-1).cpu()
    else:
        assert isinstance(target, (int, str))
        idx = torch.full((bsz,), resolve_index(kind, model.config, tokenizer, target))
    if isinstance(foil, (tuple, list)):
        fo = _per_input(kind, model.config, tokenizer, foil, bsz, "foil")
    else:
        fo = none if foil is None else torch.full((bsz,), resolve_index(kind, model.config, tokenizer, foil))
    if foil is not None and bool((fo == idx).any()):
        same = int((fo == idx).int().argmax())
        given = foil if not isinstance(foil, (tuple, list)) else foil[same]
        word = given if kind == "classifier" or tokenizer is None else repr(tokenizer.decode([int(fo[same])]))
        named = f"'{given}'" if word == given else f"{word} (id {int(fo[same])})"
        raise MixlensError(
            f"the foil {named} is the target itself"
            f"{f' (input {same + 1})' if isinstance(foil, (tuple, list)) else ''}; a contrast needs two different "
            f"{'classes' if kind == 'classifier' else 'tokens'}"
        )
    if kind == "classifier":
        labels = {int(k): str(v) for k, v in (model.config.id2label or {}).items()}

        def name(i: int) -> str:
            return labels.get(i, str(i))
    else:

        def name(i: int) -> str:
            return token_label(tokenizer, i)

    what = "class" if kind == "classifier" else "token"
    targets = [
        Target(what, int(i), name(int(i)), None if int(o) < 0 else int(o), None if int(o) < 0 else name(int(o)))
        for i, o in zip(idx, fo, strict=True)
    ]
    return targets, Readout(kind, "", idx, fo, pos)


def of_request(
    kind: str, model: Any, tokenizer: Any, inputs: dict[str, torch.Tensor], request: Request, foil: Any, position: Any
) -> tuple[list[Target], Readout]:
    """The targets and readout of a resolved `Request` (no model output read)."""
    bsz = inputs["attention_mask"].shape[0]
    if foil is not None or position is not None:
        raise MixlensError("a resolved request holds its foil and position: drop foil and position")
    if len(request.index) != bsz:
        raise MixlensError(f"the request names {len(request.index)} inputs for a batch of {bsz}")
    if kind == "encoder":
        raise MixlensError("a sentence encoder has one target, its pooled embedding: drop --target/--foil")
    idx = torch.tensor(request.index, dtype=torch.long)
    fo = torch.tensor(request.foil, dtype=torch.long)
    pos = (
        positions(kind, inputs, tokenizer)
        if request.position is None
        else torch.tensor(request.position, dtype=torch.long)
    )
    what = "class" if kind == "classifier" else "token"
    if kind == "classifier":
        labels = {int(k): str(v) for k, v in (model.config.id2label or {}).items()}
        name: Callable[[int], str] = lambda i: labels.get(i, str(i))  # noqa: E731
    else:
        name = lambda i: token_label(tokenizer, i)  # noqa: E731
    targets = [
        Target(what, i, name(i), None if f < 0 else f, None if f < 0 else name(f))
        for i, f in zip(request.index, request.foil, strict=True)
    ]
    return targets, Readout(kind, "", idx, fo, pos, logprob=request.logprob)


def trace_output(trace: Any) -> Any:
    """The model's output on a trace's inputs (`.logits`, `.last_hidden_state`): what its captured forward pass
    kept, else one plain forward pass, whose result the trace then keeps (an inputs-only trace)."""
    if trace.logit_at is not None:  # a trace with some positions' logits: every position's, from a plain forward
        with torch.no_grad():
            return trace.model(**trace.inputs)
    if trace.logits is None and trace.hidden is None:
        with torch.no_grad():
            out = trace.model(**trace.inputs)
        trace.logits = getattr(out, "logits", None)
        trace.hidden = getattr(out, "last_hidden_state", None) if trace.logits is None else None
    return SimpleNamespace(logits=trace.logits, last_hidden_state=trace.hidden)
