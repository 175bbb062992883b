"""Options and input handling shared by the commands.

Only the standard library, typer, `mixlens.errors` and the shipped catalog (JSON) load here: every command's
signature is built from these at start-up, and `mixlens --help` must not pay for torch.
"""

from __future__ import annotations

import functools
import inspect
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import typer

from mixlens import catalog
from mixlens.commands.output import TableFormat, check_writable
from mixlens.errors import MixlensError, optional_import


def model_option() -> Any:
    """`--model/-m`: a local HF model directory or hub id."""
    return typer.Option(
        None, "--model", "-m", help="Local HF model directory or hub id (default: bundled all-MiniLM-L6-v2)."
    )


def gguf_file_option() -> Any:
    """`--gguf-file`: a GGUF weights file inside the --model directory (needs the `gguf` extra)."""
    return typer.Option(
        None, "--gguf-file", help='Load a GGUF file of the --model directory (pip install "mixlens[gguf]").'
    )


def model_head_option() -> Any:
    """`--model-head`: the model's output head class (not an attention head)."""
    return typer.Option(
        None,
        "--model-head",
        help="Model output head to load: base, masked-lm, sequence-classification, causal-lm "
        "(default: from the model config).",
    )


def deprecated_head_option() -> Any:
    """`--head`: the old name of `--model-head`, kept working (hidden, warns)."""
    return typer.Option(None, "--head", hidden=True, help="Deprecated: use --model-head.")


def allow_random_head_option() -> Any:
    return typer.Option(
        False,
        "--allow-random-head",
        help="Accept a model head whose weights are not in the checkpoint (random, newly initialised).",
    )


def pick_model_head(model_head: str | None, head: str | None) -> str | None:
    """`--model-head`, or the deprecated `--head` (with a warning); both at once is an error."""
    if head is None:
        return model_head
    if model_head is not None and model_head != head:
        raise MixlensError("give the model head once: --model-head (--head is its deprecated old name)")
    typer.echo("warning: --head is deprecated here; use --model-head", err=True)
    return head


def max_length_option() -> Any:
    """`--max-length`: the same bound and message in every command."""
    return typer.Option(None, "--max-length", min=1, help="Token limit per input (default: the model's).")


def dtype_option() -> Any:
    """`--dtype`: the dtype the model's forward pass runs in (the decompositions accumulate in float32)."""
    return typer.Option(
        None,
        "--dtype",
        help="Forward pass dtype: float32 (default), bfloat16, float16, or auto (the checkpoint's own); the "
        "decompositions accumulate in float32.",
    )


def device_option() -> Any:
    """`--device`: the torch device the model runs on."""
    return typer.Option(None, "--device", help="Device: cpu (default), cuda, cuda:N, or auto (cuda when available).")


def family_option() -> Any:
    """`--family NAME`: read the model under that family's layout (`mixlens families`), checked on a probe input."""
    return typer.Option(
        None,
        "--family",
        help="Read the model under this family's layout (mixlens families lists them), checked on a probe input; "
        "default: its model type's, or for a model type not in the table the first layout that passes the check.",
    )


@dataclass(frozen=True)
class Runtime:
    """How a command's models load (its `--dtype`, `--device`, `--family`; None: `mixlens.load`'s defaults). The
    command loads every model through `runtime.load(...)`, which passes them to `mixlens.load` as explicit
    arguments, as a Python caller does."""

    dtype: str | None = None
    device: str | None = None
    family: str | None = None

    def checked(self) -> Runtime:
        """These settings checked before any model loads (one `MixlensError` line), the device resolved."""
        from mixlens.adapters import family_named
        from mixlens.loading import dtype_name, resolve_device

        if self.dtype is not None:
            dtype_name(self.dtype)
        device = None if self.device is None else resolve_device(self.device)
        if self.family is not None:
            family_named(self.family)
        return replace(self, device=device)

    def load(self, model: str | None, **kwargs: Any) -> Any:
        """`mixlens.load(model, **kwargs)` with these settings as its explicit `dtype`, `device` and `family`."""
        from mixlens.lens import load

        return load(model, dtype=self.dtype, device=self.device, family=self.family, **kwargs)


NO_RUNTIME = Runtime()  # a command called without `runtime_options`: `mixlens.load`'s defaults


def runtime_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with `--dtype`, `--device` and `--family` added after its own options, given to it as
    `runtime` (a `Runtime`): it loads every model through `runtime.load(...)` (explicit `dtype`, `device`, `family`),
    which then runs in that dtype on that device, read under that family's layout. All are checked before the
    command starts (an unknown dtype or family, a CUDA device this machine lacks: one line, exit code 2)."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "runtime"]
    added = [
        inspect.Parameter("dtype", keyword, default=dtype_option(), annotation=str | None),
        inspect.Parameter("device", keyword, default=device_option(), annotation=str | None),
        inspect.Parameter("family", keyword, default=family_option(), annotation=str | None),
    ]

    @functools.wraps(command)
    def run(
        *args: Any, dtype: str | None = None, device: str | None = None, family: str | None = None, **kwargs: Any
    ) -> Any:
        check_fast(kwargs)  # mistakes found before torch is imported (seconds on a small machine)
        return command(*args, runtime=Runtime(dtype, device, family).checked(), **kwargs)

    signature = inspect.Signature([*own, *added])
    del run.__wrapped__  # typer reads this signature, not the command's
    run.__signature__ = signature  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
    return run


def check_fast(values: dict[str, Any]) -> None:
    """A command's arguments that can be checked without torch, checked before it loads: the `--model` path and
    the `--method` names (from the shipped catalog)."""
    method = values.get("method")
    check_method_names([method] if isinstance(method, str) else list(method or []))
    check_model_path(values.get("model"), values.get("gguf_file"))


def check_method_names(given: Sequence[str]) -> None:
    """Unknown method names (`all` aside: explain's word for every method), with the closest valid name."""
    from mixlens.errors import did_you_mean

    valid = [m["name"] for m in catalog.load()]
    registry = sys.modules.get("mixlens.methods.registry")  # already imported: methods registered in this process
    if registry is not None:  # (a plug-in's, not in the shipped catalog) count too; a fresh CLI process has none
        valid += [n for n in registry.REGISTRY if n not in valid]
    for name in given:
        if name not in valid and name != "all":
            raise MixlensError(f"unknown method '{name}'{did_you_mean(name, valid)}; valid methods: {', '.join(valid)}")


def check_model_path(model: str | None, gguf_file: str | None = None) -> None:
    """A `--model` that names a local file or folder by mistake, said as such rather than as a failed hub download:
    a GGUF file (it goes to --gguf-file, with its folder as --model), or a path that does not exist (with the
    closest name in its folder)."""
    from mixlens.errors import did_you_mean

    if model is None:
        return
    p = Path(model).expanduser()
    gguf = p.suffix.lower() == ".gguf"
    if gguf and gguf_file is None:
        folder = str(p.parent) if str(p.parent) != "" else "."
        state = "" if p.is_file() else f" (there is no such file: {p})"
        raise MixlensError(
            f"--model takes a folder or hub id, not a GGUF file{state}; give its folder and its name: "
            f"--model {folder} --gguf-file {p.name}"
        )
    if p.exists() or not model.strip():
        return
    parent = p.parent
    looks_local = model.startswith((".", "/", "~")) or "\\" in model or model.count("/") > 1
    looks_local |= model.count("/") == 1 and parent.is_dir()  # 'models/smolm2': the folder 'models' is here
    if not looks_local:
        return  # a hub id: `load` downloads it (or says why not)
    hint = ""
    if parent.is_dir():
        names = sorted(c.name for c in parent.iterdir() if c.is_dir())
        hint = did_you_mean(p.name, names)
        hint = f"{hint}; {parent} holds: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''}" if names else hint
    raise MixlensError(f"model path '{model}' does not exist: no such folder{hint}")


def data_option(help: str = "TSV/CSV/JSONL/Parquet/plain-text file.") -> Any:
    """`--data/-d`: the dataset file (required)."""
    return typer.Option(..., "--data", "-d", help=help)


def text_column_option(help: str = "Column holding the text (default: sentence/text/...).") -> Any:
    return typer.Option(None, "--text-column", help=help)


def pair_column_option(help: str = "Column holding the second text of a pair.") -> Any:
    return typer.Option(None, "--pair-column", help=help)


def limit_option(help: str = "Use only the first N examples.") -> Any:
    return typer.Option(None, "--limit", "-n", help=help)


def batch_size_option(default: int = 32, help: str | None = "Inputs per forward pass.") -> Any:
    return typer.Option(default, "--batch-size", min=1, help=help)


@dataclass(frozen=True)
class Dataset:
    """The options every dataset command starts with: `--data --model --gguf-file --text-column --pair-column
    --limit --batch-size` (a command takes them as one `ds: Dataset` parameter, see `dataset_command`)."""

    data: str
    model: str | None
    gguf_file: str | None
    text_column: str | None
    pair_column: str | None
    limit: int | None
    batch_size: int

    def texts(self) -> list[Any]:
        """The text (or sentence pair) of each of the first --limit examples."""
        return [ex.text for ex in read_examples(self.data, self.text_column, self.pair_column, check_limit(self.limit))]

    def load(self, runtime: Runtime) -> Any:
        return runtime.load(self.model, gguf_file=self.gguf_file)


def dataset_command(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command(ds: Dataset, **rest)` as a typer command with the `Dataset` options first, then its own."""
    block = (
        ("data", str, data_option()),
        ("model", str | None, model_option()),
        ("gguf_file", str | None, gguf_file_option()),
        ("text_column", str | None, text_column_option()),
        ("pair_column", str | None, pair_column_option()),
        ("limit", int | None, limit_option()),
        ("batch_size", int, batch_size_option()),
    )
    assert [name for name, _, _ in block] == [f.name for f in fields(Dataset)]
    return option_block(*block, into=Dataset)(command)


def method_list_option(help: str = "Method name (repeatable); default: attention, norm, norm_res, norm_resln.") -> Any:
    """`--method NAME` (repeatable)."""
    return typer.Option(None, "--method", help=help)


def method_options_option(help: str = "Method option METHOD.KEY=VALUE (repeatable).") -> Any:
    """`--option METHOD.KEY=VALUE` (repeatable), read by `parse_options`."""
    return typer.Option(None, "--option", help=help)


def writable_file(value: Path | None) -> Path | None:
    """`--out FILE` callback: a file that cannot be written (a directory, a device or FIFO, no permission) is
    refused while the arguments are read, before any work (`check_writable`)."""
    if value is not None:
        check_writable(value)
    return value


def writable_dir(value: Path | None) -> Path | None:
    """`--out DIR` callback: `writable_file` for an output directory."""
    if value is not None:
        check_writable(value, directory=True)
    return value


def out_dir_option(default: str, help: str) -> Any:
    """`--out/-o DIR`: the directory a dataset command writes its tables (and figures) to."""
    return typer.Option(Path(default), "--out", "-o", help=help, callback=writable_dir)


def table_format_option(help: str | None = None) -> Any:
    """`--format/-f table|csv|json|parquet` (`TableFormat`)."""
    return typer.Option(TableFormat.table, "--format", "-f", help=help)


def figures_option(help: str) -> Any:
    """`--figures`: figures are opt-in."""
    return typer.Option(False, "--figures", help=help)


def view_option(help: str = "attn or norm.") -> Any:
    """`--view attn|norm`: attention weights or the norm-based maps (checked by `check_view`)."""
    return typer.Option("attn", "--view", help=help)


def metric_option(help: str = "sts, mlm or accuracy; default from the model head.") -> Any:
    """`--metric` of the head-disabling commands."""
    return typer.Option(None, "--metric", help=help)


def score_column_option() -> Any:
    return typer.Option("score", "--score-column", help="Gold similarity column (sts).")


def label_column_option() -> Any:
    return typer.Option("label", "--label-column", help="Gold label column (accuracy).")


def parse_options(items: Sequence[str] | None) -> dict[str, dict[str, object]]:
    """`--option METHOD.KEY=VALUE` → {method: {key: value}}, VALUE converted to the option's declared type and
    checked by the method registry (before any model loads)."""
    from mixlens.methods.registry import parse_option

    out: dict[str, dict[str, object]] = {}
    for item in items or []:
        name, eq, raw = item.partition("=")
        method, dot, key = name.partition(".")
        if not (eq and dot and method and key):
            raise MixlensError(f"bad --option '{item}'; expected METHOD.KEY=VALUE, e.g. globenc_rollout.normalize=true")
        value = parse_option(method, key, raw)
        if key in out.get(method, {}):
            raise MixlensError(f"--option {method}.{key} is given twice ({out[method][key]} and {value}); give it once")
        out.setdefault(method, {})[key] = value
    return out


def check_methods(given: Sequence[str] | None) -> list[str]:
    """The requested method names (default: the methods the registry declares a default of `analyze`); unknown
    names fail before any model loads."""
    from mixlens.methods import get, registry

    methods = list(given) if given else registry.defaults("analyze")
    for m in methods:
        get(m)
    return methods


def check_view(view: str) -> str:
    from mixlens.stats.heads import VIEWS

    if view not in VIEWS:
        raise MixlensError(f"unknown view '{view}'; valid: {', '.join(VIEWS)}")
    return view


def check_limit(limit: int | None) -> int | None:
    if limit is not None and limit < 1:
        raise MixlensError("--limit must be at least 1")
    return limit


def read_examples(data: str, text_column: str | None, pair_column: str | None, limit: int | None) -> list[Any]:
    """The first `limit` examples of a data file (through the shared corpus readers, which refuse a file without
    one usable row)."""
    from mixlens.corpus.readers import iter_examples

    out: list[Any] = []
    for ex in iter_examples(data, text_column, pair_column):
        if limit is not None and len(out) >= limit:
            break
        out.append(ex)
    return out


def check_argv(args: Sequence[str]) -> None:
    """Refuse arguments that are not valid text: Python decodes argv with surrogateescape, so invalid UTF-8
    bytes arrive as lone surrogates that would fail far later (tokenizer, JSON, file names)."""
    for k, arg in enumerate(args):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            prev = args[k - 1] if k and args[k - 1].startswith("-") else None
            what = f"the value of {prev}" if prev else f"argument {k + 1}"
            raise MixlensError(f"{what} is not valid UTF-8 text: '{shown}'") from None


def precheck_model(
    model: str | None,
    head: str | None,
    methods: Sequence[str],
    texts: Sequence[Any],
    max_length: int | None,
    gguf_file: str | None = None,
) -> None:
    """Errors that need only the config and the tokenizer, before the weights load: each method's declared
    `precheck` (e.g. decompx without a sequence-classification head, attention_flow over its token limit)."""
    from mixlens.methods import get

    checks = [get(m).precheck for m in methods]
    if not any(checks):
        return
    import transformers

    from mixlens.lens import head_for, resolve_source
    from mixlens.methods.registry import Planned

    src, local = resolve_source(model, gguf_file)
    gguf = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        config = transformers.AutoConfig.from_pretrained(src, local_files_only=local, **gguf)
    except (OSError, ValueError):
        return  # `load` says why, with its own message

    def token_counts() -> list[int]:
        tok = transformers.AutoTokenizer.from_pretrained(src, **gguf)
        counts = []
        for text in texts:
            pair = text if isinstance(text, tuple) else (text,)
            counts.append(len(tok(*pair, truncation=max_length is not None, max_length=max_length)["input_ids"]))
        return counts

    plan = Planned(config, head or head_for(config), functools.cache(token_counts))
    for check in checks:
        if check is not None:
            check(plan)


INVOCATION: list[str] = []  # the command line of this run (set by `mixlens.cli.main`), e.g. to say how to resume


def interrupted(kept: str) -> typer.Exit:
    """Say on stderr, in one line, that a resumable run was interrupted, what it kept (`kept`) and how to resume it
    (this run's command line); the exit (code 130) to raise."""
    typer.echo(
        f"mixlens: interrupted; {kept}. Resume with the same command: {shlex.join(['mixlens', *INVOCATION])}", err=True
    )
    return typer.Exit(130)


def quiet_libraries() -> None:
    """Library chatter (hub retries, progress bars, captum's notes on its hooks) would bury our one-line messages.
    Before transformers is imported this only sets the environment it reads at import (so a command that never
    loads a model, e.g. `mixlens methods`, does not pay for importing it); after, its own settings."""
    import logging
    import os
    import sys
    import warnings

    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    else:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("huggingface_hub").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", category=UserWarning, module="captum")
    if not sys.stderr.isatty():
        # Plain tqdm bars (transformers' GGUF de-quantization uses one directly, past its progress switch) into a
        # pipe or a log file: TQDM_DISABLE is read when tqdm is imported, which a command does only later.
        os.environ.setdefault("TQDM_DISABLE", "1")


def check_wordfreq_lang(lang: str) -> str:
    """A language `wordfreq` has a word list for (its lists are cached: the study reads the same one)."""
    wordfreq = optional_import("wordfreq", "studies")
    try:
        wordfreq.get_frequency_list(lang)
    except LookupError:
        langs = ", ".join(sorted(wordfreq.available_languages()))
        raise MixlensError(f"wordfreq has no word list for language '{lang}'; available: {langs}") from None
    return lang


def disable_option() -> Any:
    """`--disable L5H8,L0H9`: heads disabled throughout the command (zero ablation = what pruning them computes;
    apply with `mixlens.interventions.disabled(lens, spec)`)."""
    return typer.Option(
        None, "--disable", help="Heads to disable throughout, as if pruned (z ← 0), e.g. L5H8,L0H9; L3 = whole layer."
    )


def option_block(
    *options: tuple[str, Any, Any], into: Callable[..., Any] = SimpleNamespace
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a block of options once for several commands: `@option_block((name, type, typer default), ...)`
    on `def cmd(block, <own options>)` gives the command the block's options first, then its own (as `--help` lists
    them); the block's values reach it as one object, `into(**values)` (default: a SimpleNamespace)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        keyword = inspect.Parameter.KEYWORD_ONLY
        own = [p.replace(kind=keyword) for p in list(inspect.signature(fn, eval_str=True).parameters.values())[1:]]
        shared = [inspect.Parameter(name, keyword, default=default, annotation=kind) for name, kind, default in options]

        @functools.wraps(fn)
        def command(**values: Any) -> Any:
            return fn(into(**{name: values.pop(name) for name, _, _ in options}), **values)

        signature = inspect.Signature([*shared, *own])
        del command.__wrapped__  # typer reads this signature, not fn's
        command.__signature__ = signature  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
        return command

    return wrap
