"""End-to-end cost on the real checkpoints of scripts/fetch_models.py (absent ones are skipped).

    python benchmarks/bench_models.py [--repeats 3] [--case smollm2-last] [--no-torch] [--no-rss] [--no-warmup]

Per case (`--case`: the cases whose id contains it): `mixlens.load` once, then `lens.analyze(text, methods,
rows=...)` end to end (maps + mixing ratios + the per-run check; with rows, row streaming) against a
plain forward pass of the same model and input, with the eager attention that `mixlens.load` selects and no key /
value cache (`model(**inputs, output_attentions=True, use_cache=False)`; from `LONG` tokens on without attention
outputs, and transformers' SDPA forward timed too), for the compiled passes and the torch passes
(`mixlens.methods.norms.COMPILED = False`, what runs on a GPU); the peak RSS of a fresh process that loads the model
and runs one analysis (long cases: and one of a plain forward); the load average (`os.getloadavg`) when the case
finished. Times are medians of `--repeats` calls after one untimed call, the forward and the analyses interleaved
(each repeat calls each once, in alternating order); a ratio is the median over repeats of that repeat's analysis /
forward, with the ratio of the medians and of the fastest calls in brackets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import mixlens
import mixlens.methods.norms as norms

ROOT = Path(os.environ.get("MIXLENS_MODELS", Path.home() / ".cache" / "mixlens" / "models")).expanduser()
METHODS = ["norm", "norm_res", "norm_resln"]
CASES = (  # id, model, tokens, methods, rows, model head
    ("mpnet-128", "all-mpnet-base-v2", 128, METHODS, None, "base"),
    ("mpnet-512", "all-mpnet-base-v2", 512, METHODS, None, "base"),
    ("smollm2-last", "smollm2-135m-instruct", 2048, [*METHODS, "globenc_rollout"], "last", "base"),
    ("smollm2-alti", "smollm2-135m-instruct", 2048, ["alti_rollout"], "last", "base"),
    ("smollm2-full", "smollm2-135m-instruct", 2048, METHODS, None, "base"),
    # the decoder methods of a prediction (#30 item 8): the causal LM, its forward computing every position's logits
    ("smollm2-altilogit-128", "smollm2-135m-instruct", 128, ["alti_logit"], None, "causal-lm"),
    ("smollm2-routes-128", "smollm2-135m-instruct", 128, ["flow_routes"], None, "causal-lm"),
    ("smollm2-altilogit-2048", "smollm2-135m-instruct", 2048, ["alti_logit"], None, "causal-lm"),
    ("smollm2-routes-2048", "smollm2-135m-instruct", 2048, ["flow_routes"], None, "causal-lm"),
    # long inputs (#33): against a plain eager forward without attention outputs, and transformers' default SDPA one
    ("smollm2-8k", "smollm2-135m-instruct", 8192, [*METHODS, "globenc_rollout", "alti_rollout"], "last", "base"),
    ("qwen2.5-8k", "qwen2.5-coder-0.5b-instruct", 8192, [*METHODS, "globenc_rollout", "alti_rollout"], "last", "base"),
    ("gemma3-32k", "gemma-3-270m", 32768, METHODS, "last", "base"),
)
LONG = 4096  # from this length the forward of a case is plain eager (no attention outputs) and SDPA is timed too
FILLER = ("the film is a charming and often affecting journey through memory , loss and the small mercies of "
          "ordinary life , told with wit and without sentimentality . ")


def text_of(lens: mixlens.Lens, n_tokens: int) -> str:
    """A text of exactly `n_tokens` tokens (special tokens included)."""
    ids = lens.tokenizer(FILLER * (n_tokens // 10), add_special_tokens=False)["input_ids"]
    special = len(lens.tokenizer("a")["input_ids"]) - len(lens.tokenizer("a", add_special_tokens=False)["input_ids"])
    return lens.tokenizer.decode(ids[: n_tokens - special])


WARMUP = True  # one untimed call of each first (numba compilation, allocator); --no-warmup on a slow machine


def timed(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each function, interleaved: every repeat calls each once, in order, so that a slow drift
    of the machine (this shared VM's speed varies by tens of percent over minutes) hits all of them alike."""
    if WARMUP:
        for fn in fns.values():
            fn()
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats):
        for k, fn in list(fns.items())[:: 1 if r % 2 == 0 else -1]:  # order alternates: a linear drift cancels
            t0 = time.perf_counter()
            fn()
            runs[k].append(time.perf_counter() - t0)
    return runs


def peak_rss(name: str, n_tokens: int, methods: list[str], rows: str | None, head: str = "base") -> float:
    """Peak RSS (GiB) of a fresh process: load + one analysis. VmHWM, not ru_maxrss: a child spawned from a large
    parent inherits the parent's ru_maxrss on Linux."""
    here = str(Path(__file__).parent)
    code = (f"import sys; sys.path.insert(0, {here!r}); import bench_models as b, mixlens; from rss import peak_gib; "
            f"lens = mixlens.load(b.ROOT / {name!r}, head={head!r}); "
            f"lens.analyze([b.text_of(lens, {n_tokens})], {methods!r}, max_length={n_tokens}, rows={rows!r}); "
            "print(peak_gib())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def forward_rss(name: str, n_tokens: int, head: str = "base") -> float:
    """Peak RSS (GiB) of a fresh process: load + one plain eager forward (no attention outputs, no cache)."""
    here = str(Path(__file__).parent)
    code = (f"import sys, torch; sys.path.insert(0, {here!r}); import bench_models as b, mixlens; "
            "from rss import peak_gib; "
            f"lens = mixlens.load(b.ROOT / {name!r}, head={head!r}); "
            f"enc = lens.encode([b.text_of(lens, {n_tokens})], max_length={n_tokens}); "
            "torch.set_grad_enabled(False); lens.model(**enc.inputs, use_cache=False); print(peak_gib())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def eager_gib(lens: mixlens.Lens, n_tokens: int) -> float:
    """What a plain eager forward holds at its peak beyond the model (GiB): transformers' additive masks (one per
    mask kind: two with sliding-window layers) and one layer's scores and probabilities, float32."""
    cfg = getattr(lens.model.config, "text_config", lens.model.config)
    kinds = len(set(getattr(cfg, "layer_types", None) or ["full_attention"]))
    return (kinds + 2 * cfg.num_attention_heads) * n_tokens**2 * 4 / 2**30


def fits(gib: float) -> bool:
    """Whether `gib` fits in 60 % of this machine's memory."""
    return gib < 0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def run_case(lens: mixlens.Lens, n_tokens: int, methods: list[str], rows: str | None, repeats: int,
             modes: tuple[bool, ...], sdpa_too: bool = True) -> dict[str, list[float]]:
    """Seconds per call, interleaved: "forward" (plain forward) and, per mode, "compiled" / "torch" (analyze), for
    one input of `n_tokens` tokens."""
    text = text_of(lens, n_tokens)
    enc = lens.encode([text], max_length=n_tokens)
    assert len(enc.tokens[0]) == n_tokens, len(enc.tokens[0])

    long = n_tokens >= LONG

    def forward() -> None:
        with torch.no_grad():
            lens.model(**enc.inputs, output_attentions=not long, use_cache=False)

    def sdpa() -> None:
        config = lens.model.config
        config._attn_implementation = "sdpa"
        try:
            with torch.no_grad():
                lens.model(**enc.inputs, use_cache=False)
        finally:
            config._attn_implementation = "eager"

    def analyze(compiled: bool) -> Callable[[], None]:
        def run() -> None:
            norms.COMPILED = compiled
            try:
                lens.analyze([text], methods, max_length=n_tokens, rows=rows)
            finally:
                norms.COMPILED = True

        return run

    eager = not long or fits(eager_gib(lens, n_tokens))  # gemma-3 at 32,768 tokens: 40 GiB, it does not fit
    fns = ({"forward": forward} if eager else {}) | ({"sdpa": sdpa} if long and sdpa_too else {})
    fns |= {("compiled" if c else "torch"): analyze(c) for c in modes}
    return timed(fns, repeats)


def ratio(runs: dict[str, list[float]], k: str, base: str = "forward") -> str:
    """The median over repeats of each repeat's `k` / `base` (calls back to back), and in brackets the ratio of the
    medians, of the fastest calls, and the worst repeat's ratio (a target "≤ X" holds in every repeat)."""
    each = [a / f for a, f in zip(runs[k], runs[base], strict=True)]
    med = statistics.median(runs[k]) / statistics.median(runs[base])
    return (f"{statistics.median(each):.2f}x ({med:.2f}x, {min(runs[k]) / min(runs[base]):.2f}x, "
            f"worst {max(each):.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", default="", help="run only the cases whose id contains this: " + ", ".join(
        c[0] for c in CASES))
    ap.add_argument("--no-torch", action="store_true", help="skip the torch passes")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS processes")
    ap.add_argument("--no-warmup", action="store_true", help="no untimed first call (numba's cache already warm)")
    ap.add_argument("--no-sdpa", action="store_true", help="long cases: no SDPA forward (at 32,768 tokens with "
                    "sliding windows it computes every n² score)")
    args = ap.parse_args()
    global WARMUP
    WARMUP = not args.no_warmup
    modes = (True,) if args.no_torch else (True, False)
    print(f"torch threads {torch.get_num_threads()}; forward: eager attention, no cache, "
          f"attention outputs below {LONG} tokens")
    print("case | model | tokens | methods | rows | forward s | analyze s (compiled) | ratio | analyze s (torch) | "
          "ratio | peak RSS GiB | load avg")
    for case, name, n_tokens, methods, rows, head in CASES:
        if args.case not in case:
            continue
        if not (ROOT / name / "config.json").is_file():
            print(f"{name}: not fetched, skipped")
            continue
        lens = mixlens.load(ROOT / name, head=head)
        runs = run_case(lens, n_tokens, methods, rows, args.repeats, modes, not args.no_sdpa)
        med = {k: statistics.median(v) for k, v in runs.items()}
        rss = "-" if args.no_rss else f"{peak_rss(name, n_tokens, methods, rows, head):.2f}"
        torch_cols = f"{med['torch']:.3f} | {ratio(runs, 'torch')}" if "torch" in med else "- | -"
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        base = "forward" if "forward" in runs else "sdpa" if "sdpa" in runs else None
        print(f"{case} | {name} | {n_tokens} | {'+'.join(methods)} | {rows or 'all'} | "
              f"{f'{med[base]:.3f}' if base else '-'} | {med['compiled']:.3f} | "
              f"{ratio(runs, 'compiled', base) if base else '-'} | {torch_cols} | {rss} | {load}", flush=True)
        if "sdpa" in runs:
            cfg = getattr(lens.model.config, "text_config", lens.model.config)
            attn_gb = cfg.num_hidden_layers * cfg.num_attention_heads * n_tokens**2 * 4 / 2**30
            if "forward" in runs:
                fwd_rss = "-" if args.no_rss else f"{forward_rss(name, n_tokens, head):.2f}"
                eager = f"plain eager forward {med['forward']:.1f} s (peak RSS {fwd_rss} GiB)"
            else:
                eager = (f"plain eager forward not run: it would hold {eager_gib(lens, n_tokens):.1f} GiB beyond "
                         "the model (masks, one layer's scores and probabilities); ratios to the SDPA forward")
            print(f"  {case}: {eager}, SDPA forward "
                  f"{med['sdpa']:.1f} s; analyze / SDPA forward {ratio(runs, 'compiled', 'sdpa')}; "
                  f"output_attentions=True would hold {attn_gb:.1f} GiB of α (layers · heads · n² · 4 B)", flush=True)


if __name__ == "__main__":
    main()
