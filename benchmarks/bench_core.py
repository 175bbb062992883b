"""Core benchmark: cost of the four norm-family methods + mixing ratios relative to a plain forward pass.

Ratio = time(traced forward + attention, norm, norm_res, norm_resln + mixing ratios, all layers) /
time(plain forward with output_attentions=True), medians of interleaved repeats in one run; the
"decomposition alone" ratio leaves out the traced forward pass. The traced forward is the one `analyze`
runs for these methods: it stops after the last attention block (they never use the last FFN or the head).
Peak RSS of the 512-token cases is measured in fresh subprocesses.

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
from mixlens.methods import get
from mixlens.methods.norms import block_norms

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


FULL = any(get(m).needs_output for m in DEFAULT_METHODS)  # False: the trace stops after the last attention block


def analysis(lens: mixlens.Lens, enc) -> None:
    decompose(lens.trace(enc, full=FULL))


def decompose(tr) -> None:
    """The four methods and the mixing ratios on an existing trace."""
    with torch.no_grad():
        bn = block_norms(tr)
        for name in DEFAULT_METHODS:
            get(name)(tr)
        _ = {v: r.sum() for v, r in bn.ratio.items()}


def ratio(lens: mixlens.Lens, texts: list[str], repeats: int) -> dict[str, float]:
    enc = lens.encode(texts)
    fwd, ana, dec = [], [], []
    with torch.no_grad():
        lens.model(**enc.inputs, output_attentions=True)
        analysis(lens, enc)
        for _ in range(repeats):
            t0 = time.perf_counter()
            lens.model(**enc.inputs, output_attentions=True)
            t1 = time.perf_counter()
            tr = lens.trace(enc, full=FULL)
            t2 = time.perf_counter()
            decompose(tr)
            t3 = time.perf_counter()
            fwd.append(t1 - t0)
            ana.append(t3 - t1)
            dec.append(t3 - t2)
    f, a, d = statistics.median(fwd), statistics.median(ana), statistics.median(dec)
    return {"tokens": enc.inputs["input_ids"].shape[1], "batch": len(texts), "forward_s": f, "analysis_s": a,
            "ratio": a / f, "decomposition_ratio": d / f}


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
enc = lens.encode([long_text(lens, {n_tokens})])
assert enc.inputs["input_ids"].shape[1] == {n_tokens}
analysis(lens, enc)
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
              f"analysis={1e3 * r['analysis_s']:8.1f} ms  ratio={r['ratio']:.2f}  "
              f"(decomposition alone {r['decomposition_ratio']:.2f})")
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
