"""Core benchmark: the public API, `lens.analyze(texts)` with the default methods (attention, norm, norm_res,
norm_resln + mixing ratios, reconstruction check, result assembly), relative to a plain forward pass.

Ratio = time(`lens.analyze(texts)`, end to end: tokenisation, traced forward, decomposition, results) /
time(plain forward with output_attentions=True on already tokenised inputs), medians of interleaved repeats in
one run. "internal" leaves out tokenisation and result assembly (traced forward + `run_methods`); "vs
tokenize+forward" also counts the tokenizer call in the plain side. Peak RSS of the 512-token cases is
measured in fresh subprocesses.

    python benchmarks/bench_core.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import csv
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import mixlens
from mixlens.lens import DEFAULT_METHODS
from mixlens.pipeline import run_methods, trace_flags

SST2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "dev.tsv"


def sst2_sentences(k: int) -> list[str]:
    if not SST2.is_file():
        return [f"a placeholder sentence number {i} with a few more words in it ." for i in range(k)]
    with SST2.open(newline="") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["sentence"].strip() for r in rows[:k]]


def long_text(lens: mixlens.Lens, n_tokens: int) -> str:
    words = ("the quick brown fox jumps over the lazy dog while a small bird sings in the old tree , "
             "and the river runs quietly past the sleeping town .").split()
    text = " ".join(words[i % len(words)] for i in range(n_tokens * 2))
    ids = lens.tokenizer(text)["input_ids"][1 : n_tokens - 1]
    return lens.tokenizer.decode(ids)


def analysis(lens: mixlens.Lens, texts: list[str]) -> None:
    lens.analyze(texts)


def ratio(lens: mixlens.Lens, texts: list[str], repeats: int) -> dict[str, float]:
    enc = lens.encode(texts)
    fwd, tok_fwd, ana, internal = [], [], [], []
    ffn, full = trace_flags(DEFAULT_METHODS)
    with torch.no_grad():
        lens.model(**enc.inputs, output_attentions=True)
        analysis(lens, texts)
        for _ in range(repeats):
            t0 = time.perf_counter()
            lens.model(**enc.inputs, output_attentions=True)
            t1 = time.perf_counter()
            lens.analyze(texts)
            t2 = time.perf_counter()
            run_methods(lens.trace(enc, ffn=ffn, full=full), DEFAULT_METHODS)
            t3 = time.perf_counter()
            inputs = lens.tokenizer(texts, padding=True, return_tensors="pt")
            lens.model(**inputs, output_attentions=True)
            t4 = time.perf_counter()
            fwd.append(t1 - t0)
            ana.append(t2 - t1)
            internal.append(t3 - t2)
            tok_fwd.append(t4 - t3)
    f, a, i, tf = (statistics.median(x) for x in (fwd, ana, internal, tok_fwd))
    return {"tokens": enc.inputs["input_ids"].shape[1], "batch": len(texts), "forward_s": f, "analyze_s": a,
            "ratio": a / f, "internal_ratio": i / f, "ratio_vs_tokenize_forward": a / tf}


def peak_rss(model: str, n_tokens: int) -> float:
    """Peak RSS (GiB) of a fresh process that loads `model` and analyses one n-token input."""
    code = f"""
import resource, sys, torch, mixlens
sys.path.insert(0, {str(Path(__file__).parent)!r})
from bench_core import long_text, analysis
if {model!r} == "bert-base-random":
    import transformers as T
    cfg = T.BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    lens = mixlens.Lens(T.AutoModel.from_config(cfg, attn_implementation="eager"), mixlens.load().tokenizer)
else:
    lens = mixlens.load()
text = long_text(lens, {n_tokens})
assert lens.encode([text]).inputs["input_ids"].shape[1] == {n_tokens}
analysis(lens, [text])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    args = ap.parse_args()
    lens = mixlens.load()
    rows = {
        "(a) 32 SST-2 dev sentences": ratio(lens, sst2_sentences(32), args.repeats),
        "(b) one 128-token input": ratio(lens, [long_text(lens, 128)], args.repeats),
        "(c) one 512-token input": ratio(lens, [long_text(lens, 512)], max(3, args.repeats // 2)),
    }
    for name, r in rows.items():
        print(f"{name:32s} tokens={r['tokens']:4d} forward={1e3 * r['forward_s']:8.1f} ms "
              f"analyze={1e3 * r['analyze_s']:8.1f} ms  ratio={r['ratio']:.2f}  (internal {r['internal_ratio']:.2f}, "
              f"vs tokenize+forward {r['ratio_vs_tokenize_forward']:.2f})")
    rss = {} if args.no_rss else {"bundled 512": peak_rss("bundled", 512),
                                  "bert-base 512": peak_rss("bert-base-random", 512)}
    for k, v in rss.items():
        print(f"peak RSS {k:14s} {v:.2f} GiB")
    print(json.dumps({"ratios": {k: round(v["ratio"], 3) for k, v in rows.items()},
                      "peak_rss_gib": {k: round(v, 3) for k, v in rss.items()},
                      "torch_threads": torch.get_num_threads(),
                      "self_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


if __name__ == "__main__":
    main()
