"""Checkpointing of `evaluate`: the examples finished so far survive a Ctrl-C (`Interrupted`) or a kill (a save
every `CHECKPOINT_EVERY` seconds), and a later run resumes after them only when it is the same run.

- the run's identity (`identity`): model, dtype, task, removal, methods, seed, and what the caller adds (the CLI:
  the data's sha256, --skip, --text-column); saved as `run` in evaluation.json, a resume of another run is refused
  naming what differs (as `mixlens corpus` does);
- one run at a time writes into a folder (`locked`: an flock held for the whole run);
- a saved evaluation is checked field by field before it is used (`read_saved`): a damaged or edited file is one
  line, never a traceback or a crash after the new examples were computed.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mixlens import jsonio
from mixlens.errors import MixlensError
from mixlens.explain.evaluation import KS, LEVELS, NO_REMOVAL, REMOVALS, Contrast, Evaluation
from mixlens.lens import dtype_name
from mixlens.runlock import run_lock

CHECKPOINT_EVERY = 60.0  # seconds between saves of the finished examples (a run killed without warning resumes)
LOCK = ".mixlens-evaluate.lock"  # in --out: held (flock) by the run writing there; holds its pid and command
FILE = "evaluation.json"
IDENTITY = ("model", "dtype", "data", "task", "skip", "text_column", "removal", "methods", "seed")
DATA_KEYS = ("data", "task")  # a finished evaluation of other data (another file or task) is never replaced


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `evaluate`: `partial` holds the Evaluations of the examples finished before it (per removal;
    empty when none finished)."""

    def __init__(self, partial: dict[str, Evaluation], total: int) -> None:
        super().__init__()
        self.partial = partial
        self.total = total


def data_stamp(path: Path) -> dict[str, object]:
    """{"sha256": ...} of a data file's bytes, or of a folder's `*.csv` files (names and bytes, sorted by name),
    read in 1 MiB blocks (never a file whole)."""
    h = hashlib.sha256()
    files = sorted(path.glob("*.csv")) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(f.name.encode() + b"\0")
        try:
            with f.open("rb") as fh:
                while block := fh.read(1 << 20):
                    h.update(block)
        except OSError as e:
            raise MixlensError(f"cannot read '{f}': {e.strerror or e}") from None
    return {"sha256": h.hexdigest()}


def identity(
    lens: Any, *, task: str, removal: str, methods: Sequence[str], seed: int, extra: dict[str, object] | None
) -> dict[str, object]:
    """The run's identity: what a resumed run must share with the interrupted one."""
    return {
        **(extra or {}),
        "model": lens.name,
        "dtype": dtype_name(lens.model.dtype),
        "task": task,
        "removal": removal,
        "methods": list(methods),
        "seed": seed,
    }


def _difference(saved: dict[str, object], now: dict[str, object], keys: Sequence[str]) -> str:
    """'key: old → new' for each of `keys` that differs ('data: other content' for the data's hash)."""
    return "; ".join(
        "data: other content" if k == "data" else f"{k}: {saved.get(k)!r} → {now.get(k)!r}"
        for k in keys
        if saved.get(k) != now.get(k)
    )


def resumed(
    resume: dict[str, Evaluation] | None,
    removals: Sequence[str],
    runs: dict[str, dict[str, object]],
    texts: list[str],
    contrasts: Sequence[Contrast] | None = None,
) -> int:
    """How many leading examples of `resume` this run keeps (`runs`: this run's identity per removal); a resume of
    another run (other identity, texts or contrasts) is a `MixlensError`."""
    if not resume:
        return 0
    kept = None
    for r in removals:
        ev = resume.get(r)
        if ev is None:
            raise MixlensError(
                f"the interrupted evaluation to resume has no removal '{r}'; use another --out or delete it"
            )
        if not ev.run:
            raise MixlensError(
                "the interrupted evaluation to resume does not record its run (an older mixlens wrote it), so "
                "mixlens cannot tell it is the same run; use another --out or delete it"
            )
        now = runs[r]
        if ev.run.get("data") != now.get("data") and "data" in now:
            raise MixlensError(
                "the data changed since the interrupted evaluation began (its content differs); "
                "use another --out or delete it"
            )
        diff = _difference(ev.run, now, [k for k in IDENTITY if k != "data"])
        if diff:
            raise MixlensError(
                f"the interrupted evaluation to resume is another run ({diff}); use another --out or delete it"
            )
        got = [e.text for e in ev.examples]
        if got != texts[: len(got)]:
            raise MixlensError("the interrupted evaluation to resume holds other texts; use another --out or delete it")
        if contrasts is not None and [e.contrast for e in ev.examples] != list(contrasts[: len(got)]):
            raise MixlensError(
                "the interrupted evaluation to resume holds other targets, foils or evidence; "
                "use another --out or delete it"
            )
        kept = len(got) if kept is None else min(kept, len(got))
    return kept or 0


def locked(out: Path, command: str | None = None) -> contextlib.AbstractContextManager[None]:
    """Hold an exclusive lock on the output folder for the whole run: a second run into the same --out is refused
    with one line naming the running one (its pid and `command`). A folder this run created is removed again when
    the run ends without writing evaluation.json (nothing is left behind)."""
    return run_lock(out, LOCK, command or shlex.join(sys.argv), "evaluate", (out / FILE).exists)


# ------------------------------------------------------------------------------------ a saved evaluation, checked


class _Bad(Exception):
    """A field of a saved evaluation that is not what `Evaluation.to_json` writes: (where, what is wrong)."""


def _number(x: object, where: str, null: bool = True) -> None:
    if x is None and null:
        return
    if isinstance(x, bool) or not isinstance(x, int | float) or (isinstance(x, float) and not math.isfinite(x)):
        raise _Bad(where, f"is {x!r}, not a number")


def _type(x: object, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    if not isinstance(x, kind) or (kind is int and isinstance(x, bool)):
        raise _Bad(where, f"is {type(x).__name__}, not {what}")
    return x


def _numbers(x: object, n: int, where: str) -> None:
    _type(x, list, where, "a list of numbers")
    assert isinstance(x, list)
    if len(x) != n:
        raise _Bad(where, f"has {len(x)} values, not {n}")
    for k, v in enumerate(x):
        _number(v, f"{where}[{k}]")


def _ints(x: object, where: str, low: int = 0, high: int | None = None) -> list[int]:
    _type(x, list, where, "a list of integers")
    assert isinstance(x, list)
    for k, v in enumerate(x):
        _type(v, int, f"{where}[{k}]", "an integer")
        if v < low or (high is not None and v >= high):
            raise _Bad(f"{where}[{k}]", f"is {v}, out of range")
    return x


def _strings(x: object, where: str) -> list[str]:
    _type(x, list, where, "a list of strings")
    assert isinstance(x, list)
    for k, v in enumerate(x):
        _type(v, str, f"{where}[{k}]", "a string")
    return x


def _example(item: object, methods: list[str], removal: str, where: str) -> None:
    e: dict = _type(item, dict, where, "an object")
    for key in ("text", "tokens", "ids", "special", "target", "f", "scores", "grad_x_input_l2", "f_removed", "f_kept"):
        if key not in e:
            raise _Bad(f"{where}.{key}", "is missing")
    _type(e["text"], str, f"{where}.text", "a string")
    n = len(_strings(e["tokens"], f"{where}.tokens"))
    if len(_ints(e["ids"], f"{where}.ids")) != n:
        raise _Bad(f"{where}.ids", f"has {len(e['ids'])} ids for {n} tokens")
    special = _type(e["special"], list, f"{where}.special", "a list of booleans")
    if len(special) != n or not all(isinstance(v, bool) for v in special):
        raise _Bad(f"{where}.special", f"is not {n} booleans")
    _type(e["target"], dict, f"{where}.target", "an object")
    _number(e["f"], f"{where}.f")
    _numbers(e["grad_x_input_l2"], n, f"{where}.grad_x_input_l2")
    scores = _type(e["scores"], dict, f"{where}.scores", "an object")
    for m in methods:
        if m not in scores:
            raise _Bad(f"{where}.scores.{m}", "is missing")
        _numbers(scores[m], n, f"{where}.scores.{m}")
    for key, levels in (("f_removed", LEVELS), ("f_kept", KS)):
        part = _type(e[key], dict, f"{where}.{key}", "an object")
        want = [] if removal == NO_REMOVAL else methods
        if sorted(part) != sorted(want):
            raise _Bad(f"{where}.{key}", f"has the methods {sorted(part)}, not {sorted(want)}")
        for m in want:
            _numbers(part[m], len(levels), f"{where}.{key}.{m}")
    if "contrast" in e:
        c = _type(e["contrast"], dict, f"{where}.contrast", "an object")
        for key in ("group", "target_word", "foil_word", "evidence_phrase"):
            _type(c.get(key), str, f"{where}.contrast.{key}", "a string")
        for key in ("target_id", "foil_id"):
            _type(c.get(key), int, f"{where}.contrast.{key}", "an integer")
        _ints(c.get("evidence"), f"{where}.contrast.evidence", 0, n)


def check_saved(obj: object) -> None:
    """Raise `_Bad(where, what)` unless `obj` is an evaluation.json as `Evaluation.to_json` (and the CLI's
    interrupted marker) writes it: every field of the right type and length."""
    doc: dict = _type(obj, dict, "the file", "a JSON object")
    for key in ("model", "version", "task"):
        _type(doc.get(key), str, key, "a string")
    if doc.get("removal") not in REMOVALS:
        raise _Bad("removal", f"is {doc.get('removal')!r}, not one of {', '.join(REMOVALS)}")
    metrics = _type(doc.get("metrics"), dict, "metrics", "an object")
    methods = list(metrics)
    if not methods:
        raise _Bad("metrics", "names no method")
    definitions = _type(doc.get("definitions"), dict, "definitions", "an object")
    _type(definitions.get("seed"), int, "definitions.seed", "an integer")
    timings = _type(doc.get("timings"), dict, "timings", "an object")
    for k, v in timings.items():
        _number(v, f"timings.{k}", null=False)
    _strings(doc.get("notes"), "notes")
    skipped = _type(doc.get("skipped", {}), dict, "skipped", "an object")
    for g, reasons in skipped.items():
        for r, k in _type(reasons, dict, f"skipped.{g}", "an object").items():
            _type(k, int, f"skipped.{g}.{r}", "an integer")
    _type(doc.get("run", {}), dict, "run", "an object")
    examples = _type(doc.get("examples"), list, "examples", "a list")
    for k, e in enumerate(examples):
        _example(e, methods, doc["removal"], f"examples[{k}]")
    if "interrupted" in doc:
        mark = _type(doc["interrupted"], dict, "interrupted", "an object")
        done = _type(mark.get("examples"), int, "interrupted.examples", "an integer")
        total = _type(mark.get("of"), int, "interrupted.of", "an integer")
        if done != len(examples) or not 0 < done <= total:
            raise _Bad("interrupted", f"says {done} of {total} examples; the file holds {len(examples)}")


def read_saved(path: Path) -> dict | None:
    """The evaluation.json at `path`, checked (`check_saved`), or None when there is none; a file that is not one
    is a `MixlensError` naming the field."""
    if not path.is_file():
        if path.exists():
            raise MixlensError(f"'{path}' is not a regular file; use another --out")
        return None
    try:
        doc = jsonio.read(path)
    except MixlensError as e:
        raise MixlensError(f"cannot resume from {path}: {e}; delete it or use another --out") from None
    interrupted = isinstance(doc, dict) and "interrupted" in doc
    try:
        check_saved(doc)
    except _Bad as e:
        where, what = e.args
        head = f"cannot resume from {path}" if interrupted else f"{path} is not an evaluation mixlens wrote"
        raise MixlensError(
            f"{head}: {where} {what} (a damaged or edited file); delete it or use another --out"
        ) from None
    return doc


def check_replace(doc: dict, path: Path, now: dict[str, object], model: str | None = None) -> None:
    """Refuse to replace the finished evaluation `doc` at `path` by a run of other data (`DATA_KEYS` of `now`) or
    of another model (`model`, when known)."""
    saved = doc.get("run") or {}
    diff = _difference(saved, now, [k for k in DATA_KEYS if k in now]) if saved else "no record of its data"
    if not diff and model is not None and saved.get("model") != model:
        diff = _difference(saved, {"model": model}, ["model"])
    if diff:
        what = "data" if not saved or any(saved.get(k) != now.get(k) for k in DATA_KEYS if k in now) else "model"
        raise MixlensError(
            f"{path} holds a finished evaluation of other {what} ({diff}); use another --out or delete it"
        )
