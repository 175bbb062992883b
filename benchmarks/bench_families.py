"""Speed per family (#42 item 7): every family of the adapter table, on a random model, against a plain forward.

    python benchmarks/bench_families.py [--repeats 3] [--tokens 128 2048] [--family llama gpt2] [--width 8]

Every family of `mixlens.adapters.FAMILIES` gets a random model. Its configuration is the one the tests use
(`tests.conftest.CONFIGS`, keyed by model type: the first of the family's model types found there; a family without
one is listed as such). Each width-like size in the configuration (hidden size, FFN width, head width, ...) is
multiplied by `--width`, so the plain forward is not all Python overhead. Layers, heads and layout stay as in the test
configuration. Learned position tables are lengthened to the longest input.

Two cases, timed end to end through the public API as users call it, one input of exactly n tokens:

- "norm": `lens.analyze([text], ["norm", "norm_res", "norm_resln"], rows=None)` (every row: full maps
  and mixing ratios, with the per-run check), against `model(**inputs, output_attentions=True)` of the base model
  (`AutoModel`; decoders also `use_cache=False`);
- "logit_attn", where the registry says it applies: `lens.analyze([text], ["logit_attn"], rows=None)` on the
  causal LM (`AutoModelForCausalLM`), against that model's own plain forward (every position's logits).

`rows=None` is explicit: `analyze`'s default for a causal LM over its long-input threshold is the last row only.

The timings are interleaved as in `bench_models.timed`: each repeat calls the forward and the analysis once, in
alternating order. A ratio is the median over repeats of that repeat's analysis / forward. The load average is printed
per row: this is a shared machine, so read ratios side by side from one run, not against another run's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import transformers as T
from bench_models import text_of, timed

import mixlens
from mixlens.adapters import FAMILIES, Family
from mixlens.errors import MixlensError
from mixlens.methods import get as get_method

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the tests' configurations
from tests.conftest import CONFIGS, random_model  # noqa: E402

NORMS = ["norm", "norm_res", "norm_resln"]
TARGET = 1.5  # #42 item 7: no family above this where the existing ones are at or below it
WIDTHS = set(  # sizes scaled by --width (whichever of them a configuration has)
    "hidden_size n_embd dim d_model intermediate_size n_inner hidden_dim ffn_dim d_ff head_dim query_pre_attn_scalar "
    "word_embed_proj_dim embedding_size moe_intermediate_size shared_expert_intermediate_size "
    "attention_head_size".split()
)
POSITIONS = ("max_position_embeddings", "n_positions")


def model_type_of(fam: Family) -> str | None:
    """The first of the family's model types with a test configuration."""
    return next((t for t in fam.model_types if t in CONFIGS), None)


def overrides(model_type: str, width: int, n_tokens: int) -> dict[str, Any]:
    """The configuration changes: width-like sizes × width, position tables long enough for n_tokens."""
    cfg = CONFIGS[model_type]().to_dict()
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if key in WIDTHS and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = value * width
        if key in POSITIONS and isinstance(value, int) and value < n_tokens + 8:
            out[key] = n_tokens + 8  # (RoBERTa's positions start after the padding index)
    return out


def lens_of(model_type: str, tokenizer: Any, head: str, width: int, n_tokens: int) -> mixlens.Lens:
    """A random model of the family (eval mode), width-scaled; the test width when scaling breaks its layout."""
    try:
        model = random_model(model_type, tokenizer, head, **overrides(model_type, width, n_tokens))
        lens = mixlens.Lens(model.eval(), tokenizer, name=f"random-{model_type}")
        lens.analyze(["a check of the scaled layout"], ["norm_resln"])
    except (MixlensError, RuntimeError, ValueError) as e:
        print(f"  {model_type}: width × {width} does not fit its layout ({str(e).splitlines()[0][:80]}); test width")
        model = random_model(model_type, tokenizer, head, **overrides(model_type, 1, n_tokens))
        lens = mixlens.Lens(model.eval(), tokenizer, name=f"random-{model_type}")
    return lens


def case(lens: mixlens.Lens, methods: list[str], n_tokens: int, repeats: int) -> tuple[float, float]:
    """(plain forward seconds, analysis / forward): medians over interleaved repeats."""
    text = text_of(lens, n_tokens)
    enc = lens.encode([text], max_length=n_tokens)
    assert len(enc.tokens[0]) == n_tokens, len(enc.tokens[0])
    extra = {"use_cache": False} if lens.adapter.family.causal else {}

    def forward() -> None:
        with torch.no_grad():
            lens.model(**enc.inputs, output_attentions=True, **extra)

    def analyze() -> None:  # every target row (full maps), as the forward computes every row
        lens.analyze([text], methods, max_length=n_tokens, rows=None)

    runs = timed({"forward": forward, "analyze": analyze}, repeats)
    each = [a / f for a, f in zip(runs["analyze"], runs["forward"], strict=True)]
    return statistics.median(runs["forward"]), statistics.median(each)


def row(fam: Family, model_type: str, tokenizer: Any, args: argparse.Namespace) -> tuple[int, list[str], float]:
    """(d, the ratio cells, the plain forward's seconds at the longest input) of one family."""
    longest = max(args.tokens)
    lens = lens_of(model_type, tokenizer, "AutoModel", args.width, longest)
    d = int(lens.adapter.layers[0].w_o.shape[1])
    cells, fwd = [], 0.0
    for n in args.tokens:
        fwd, r = case(lens, NORMS, n, args.repeats)
        cells.append(cell(r))
    del lens
    if get_method("logit_attn").refusal(fam) is None:
        lm = lens_of(model_type, tokenizer, "AutoModelForCausalLM", args.width, longest)
        cells += [cell(case(lm, ["logit_attn"], n, args.repeats)[1]) for n in args.tokens]
    else:
        cells += ["—"] * len(args.tokens)
    return d, cells, fwd


def cell(ratio: float) -> str:
    """A ratio for the table, in bold above the target."""
    return f"**{ratio:.2f}**" if ratio > TARGET else f"{ratio:.2f}"


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--family", nargs="+", default=[""], help="only the families whose name contains one of these")
    ap.add_argument("--width", type=int, default=8, help="factor on the test configurations' width-like sizes")
    args = ap.parse_args()
    tokenizer = mixlens.load().tokenizer
    longest = max(args.tokens)
    tokenizer.model_max_length = longest + 8  # the bundled tokenizer's 512 is not these models' limit
    print(
        f"torch threads {torch.get_num_threads()}, transformers {T.__version__}, width × {args.width}, "
        f"repeats {args.repeats}; ratios: analysis / plain forward (median of interleaved pairs; bold: above {TARGET})"
    )
    cols = " | ".join(f"{m} {n}" for m in ("norm", "logit_attn") for n in args.tokens)
    print(f"| family | model type | d | {cols} | forward s at {longest} | load avg |")
    print("|" + " --- |" * (5 + 2 * len(args.tokens)))
    for fam in FAMILIES:
        if not any(f in fam.name for f in args.family):
            continue
        model_type = model_type_of(fam)
        if model_type is None:
            print(f"| {fam.name} | {', '.join(fam.model_types)} | no random configuration in tests/conftest.py |")
            continue
        try:
            d, cells, fwd = row(fam, model_type, tokenizer, args)
        except (MixlensError, RuntimeError, ValueError) as e:  # one family's failure does not end the table
            print(f"| {fam.name} | {model_type} | failed: {str(e).splitlines()[0][:100]} |", flush=True)
            continue
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"| {fam.name} | {model_type} | {d} | {' | '.join(cells)} | {fwd:.3f} | {load} |", flush=True)


if __name__ == "__main__":
    main()
