"""Core benchmark: the public API, `lens.analyze(texts)` with the default methods (attention, norm, norm_res,
norm_resln + mixing ratios, reconstruction check, result assembly), relative to a plain forward pass.

Ratio = time(`lens.analyze(texts)`, end to end: tokenisation, traced forward, decomposition, results) /
time(plain forward with output_attentions=True on already tokenised inputs), the median over repeats of each
repeat's own ratio: the two calls run back to back, in alternating order, so that this shared VM's drift of tens
of percent over minutes cancels out of each pair. Beside it: the ratio of the medians and of the fastest runs. The
parts: "traced" = `lens.trace` (the forward pass with capture hooks, stopped after the last attention block),
"decomposition" = `run_methods` on that trace, "rest" = analyze − traced − decomposition (tokenisation, batching,
result assembly); "vs tokenize+forward" also counts the tokenizer call in the plain side. Peak RSS of the
512-token cases is measured in fresh subprocesses. The load average is printed before and after: quote numbers
only from an idle machine. The median minor page faults per call of either side are printed too: on a VM each can
cost microseconds, and glibc gives fresh pages to whichever call grows its heap.

    python benchmarks/bench_core.py [--repeats 9] [--no-rss]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rss import peak_gib

import mixlens
from mixlens.lens import DEFAULT_METHODS
from mixlens.pipeline import run_methods, trace_flags

TARGET = 1.3  # issue #15 item 8: analyze / plain forward at every size
SST2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "dev.tsv"


def sst2_sentences(k: int) -> list[str]:
    if not SST2.is_file():
        return [f"a placeholder sentence number {i} with a few more words in it ." for i in range(k)]
    with SST2.open(newline="") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["sentence"].strip() for r in rows[:k]]


def long_text(lens: mixlens.Lens, n_tokens: int) -> str:
    words = (
        "the quick brown fox jumps over the lazy dog while a small bird sings in the old tree , "
        "and the river runs quietly past the sleeping town ."
    ).split()
    text = " ".join(words[i % len(words)] for i in range(n_tokens * 2))
    ids = lens.tokenizer(text)["input_ids"][1 : n_tokens - 1]
    return lens.tokenizer.decode(ids)


def analysis(lens: mixlens.Lens, texts: list[str]) -> None:
    lens.analyze(texts)


def ratio(lens: mixlens.Lens, texts: list[str], repeats: int) -> dict[str, float]:
    enc = lens.encode(texts)
    times: dict[str, list[float]] = {k: [] for k in ("forward", "analyze", "traced", "decomposition", "tok_fwd")}
    faults: dict[str, list[int]] = {"forward": [], "analyze": []}
    ffn, to_output = trace_flags(DEFAULT_METHODS)
    with torch.no_grad():
        for _ in range(2):  # warm-up: compiled kernels, caches, the allocator
            lens.model(**enc.inputs, output_attentions=True)
            analysis(lens, texts)
        for k in range(repeats):  # each call's result is dropped after its timer stops, as a caller keeps it
            pair: dict[str, float] = {}
            for name in ("forward", "analyze") if k % 2 == 0 else ("analyze", "forward"):
                f0, t0 = minor_faults(), time.perf_counter()
                out = lens.model(**enc.inputs, output_attentions=True) if name == "forward" else lens.analyze(texts)
                pair[name] = time.perf_counter() - t0
                faults[name].append(minor_faults() - f0)
                del out
            t2b = time.perf_counter()
            trace = lens.trace(enc, ffn=ffn, to_output=to_output)
            t3 = time.perf_counter()
            step = run_methods(trace, DEFAULT_METHODS)
            t4 = time.perf_counter()
            del trace, step
            t4b = time.perf_counter()
            inputs = lens.tokenizer(texts, padding=True, return_tensors="pt")
            out = lens.model(**inputs, output_attentions=True)
            t5 = time.perf_counter()
            del out
            for key, dt in zip(times, (pair["forward"], pair["analyze"], t3 - t2b, t4 - t3, t5 - t4b), strict=True):
                times[key].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    f = med["forward"]
    return {
        "tokens": enc.inputs["input_ids"].shape[1],
        "batch": len(texts),
        "forward_s": f,
        "analyze_s": med["analyze"],
        "ratio": statistics.median(a / b for a, b in zip(times["analyze"], times["forward"], strict=True)),
        "ratio_of_medians": med["analyze"] / f,
        "ratio_of_fastest": min(times["analyze"]) / min(times["forward"]),
        "traced": med["traced"] / f,
        "decomposition": med["decomposition"] / f,
        "rest": (med["analyze"] - med["traced"] - med["decomposition"]) / f,
        "ratio_vs_tokenize_forward": med["analyze"] / med["tok_fwd"],
        "faults": {k: statistics.median(v) for k, v in faults.items()},
    }


def minor_faults() -> int:
    """Minor page faults of this process so far: on a VM each can cost microseconds, and glibc hands fresh pages to
    whichever call grows the heap, so they are printed beside the ratio."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def peak_rss(model: str, n_tokens: int) -> float:
    """Peak RSS (GiB) of a fresh process that loads `model` and analyses one n-token input."""
    code = f"""
import sys, torch, mixlens
sys.path.insert(0, {str(Path(__file__).parent)!r})
from bench_core import long_text, analysis
from rss import peak_gib

if {model!r} == "bert-base-random":
    import transformers as T
    cfg = T.BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    lens = mixlens.Lens(T.AutoModel.from_config(cfg, attn_implementation="eager"), mixlens.load().tokenizer)
else:
    lens = mixlens.load()
text = long_text(lens, {n_tokens})
assert lens.encode([text]).inputs["input_ids"].shape[1] == {n_tokens}
analysis(lens, [text])
print(peak_gib())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    args = ap.parse_args()
    lens = mixlens.load()
    print(
        f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, torch threads {torch.get_num_threads()}"
    )
    import llvmlite.binding as ll
    from numba.core import registry

    features = registry.cpu_target.target_context.codegen()._tm_features  # what numba compiles the kernels for
    width = "off" if "-prefer-256-bit" in features else "as LLVM tunes this CPU"
    print(f"CPU {ll.get_host_cpu_name()}: numba kernels compiled with prefer-256-bit {width}")
    rows = {
        "(a) 32 SST-2 dev sentences": ratio(lens, sst2_sentences(32), args.repeats),
        "(b) one 128-token input": ratio(lens, [long_text(lens, 128)], args.repeats),
        "(c) one 512-token input": ratio(lens, [long_text(lens, 512)], args.repeats),
    }
    for name, r in rows.items():
        print(
            f"{name:28s} tokens={r['tokens']:4d} forward={1e3 * r['forward_s']:7.1f} ms "
            f"analyze={1e3 * r['analyze_s']:7.1f} ms  ratio={r['ratio']:.2f} (of medians {r['ratio_of_medians']:.2f}, "
            f"fastest {r['ratio_of_fastest']:.2f}; target <= {TARGET})  traced {r['traced']:.2f} + decomposition "
            f"{r['decomposition']:.2f} + rest {r['rest']:.2f}; vs tokenize+forward {r['ratio_vs_tokenize_forward']:.2f}"
            f"; page faults per call: forward {r['faults']['forward']:.0f}, analyze {r['faults']['analyze']:.0f}"
        )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rss = (
        {}
        if args.no_rss
        else {"bundled 512": peak_rss("bundled", 512), "bert-base 512": peak_rss("bert-base-random", 512)}
    )
    for k, v in rss.items():
        print(f"peak RSS {k:14s} {v:.2f} GiB")
    print(
        json.dumps(
            {
                "ratios": {k: round(v["ratio"], 3) for k, v in rows.items()},
                "parts": {k: {p: round(v[p], 3) for p in ("traced", "decomposition", "rest")} for k, v in rows.items()},
                "peak_rss_gib": {k: round(v, 3) for k, v in rss.items()},
                "torch_threads": torch.get_num_threads(),
                "self_rss_gib": peak_gib(),
            }
        )
    )


if __name__ == "__main__":
    main()
