"""Global-methods benchmark on the bundled model (all-MiniLM-L6-v2), ratios measured in one run.

(1) time(globenc + globenc_rollout + alti + alti_rollout on a trace) / time(plain forward), batch of 32 SST-2
    dev sentences (target ≤ 1.5); also the whole path (traced forward with FFN capture + the four methods).
(2) time(value_zeroing, all layers) / (L · n · time(one plain single-layer pass over the batch)), n = padded
    length (target ≤ 1.5).
(3) peak RSS of a fresh process that loads the model with a classification head and runs DecompX on one
    256-token input (target < 4 GB); also its wall time.
(4) attention_flow wall time at its length limit (one input).
Medians of interleaved repeats.

    python benchmarks/bench_global.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rss import peak_gib

import mixlens
from mixlens.methods import get
from mixlens.methods.decompx import decompositions
from mixlens.methods.rollout import FLOW_MAX_TOKENS
from mixlens.trace import hooked

SST2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "dev.tsv"
GLOBAL = ("globenc", "globenc_rollout", "alti", "alti_rollout")


def sst2_sentences(k: int) -> list[str]:
    if not SST2.is_file():
        sys.exit(f"missing {SST2}")
    with SST2.open(newline="") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["sentence"].strip() for r in rows[:k]]


def text_of(lens: mixlens.Lens, n_tokens: int) -> str:
    """SST-2 sentences joined and cut to exactly n_tokens (special tokens included)."""
    joined = " ".join(sst2_sentences(200))
    ids = lens.tokenizer(joined)["input_ids"][1 : n_tokens - 1]
    return lens.tokenizer.decode(ids)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def global_ratio(lens: mixlens.Lens, enc, repeats: int) -> dict[str, float]:
    fwd, methods, whole = [], [], []

    def run_methods(tr) -> None:
        for name in GLOBAL:
            get(name)(tr)

    with torch.no_grad():
        lens.model(**enc.inputs)
        run_methods(lens.trace(enc, ffn=True))
        for _ in range(repeats):
            fwd.append(timed(lambda: lens.model(**enc.inputs)))
            tr = lens.trace(enc, ffn=True)
            methods.append(timed(lambda tr=tr: run_methods(tr)))
            whole.append(timed(lambda: run_methods(lens.trace(enc, ffn=True))))
    f, m, w = (statistics.median(v) for v in (fwd, methods, whole))
    return {"forward_ms": 1e3 * f, "methods_ms": 1e3 * m, "ratio_methods": m / f, "ratio_with_trace": w / f}


def value_zeroing_ratio(lens: mixlens.Lens, enc, repeats: int) -> dict[str, float]:
    with torch.no_grad():
        tr = lens.trace(enc)
        n_layers = tr.adapter.n_layers

        def one_pass(i: int) -> None:  # layer i alone on its captured input, as value zeroing runs it
            with hooked(tr.adapter, start=i, resid_pre=tr.layers[i].x, stop_after=i):
                lens.model(**enc.inputs)

        single = statistics.median(sum(timed(lambda i=i: one_pass(i)) for i in range(n_layers)) for _ in range(repeats))
        vz = timed(lambda: get("value_zeroing")(lens.trace(enc)))
    n = enc.inputs["input_ids"].shape[1]
    return {"tokens": n, "layer_passes_ms": 1e3 * single, "value_zeroing_s": vz, "ratio": vz / (n * single)}


def decompx_child() -> None:

    torch.manual_seed(0)
    lens = mixlens.load(head="sequence-classification")
    enc = lens.encode([text_of(lens, 256)])
    assert enc.inputs["input_ids"].shape[1] == 256
    t0 = time.perf_counter()
    tr = lens.trace(enc, ffn=True)
    dec = get("decompx_classes")(tr)
    wall = time.perf_counter() - t0
    err = decompositions(tr)[0].error  # cached by the call above
    print(json.dumps({"rss_gib": peak_gib(), "wall_s": wall, "rel_error": err, "classes": list(dec.shape)}))


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decompx-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.decompx_child:
        decompx_child()
        return
    lens = mixlens.load()
    enc = lens.encode(sst2_sentences(32))
    g = global_ratio(lens, enc, args.repeats)
    print(
        f"(1) 32 SST-2 sentences (padded to {enc.inputs['input_ids'].shape[1]} tokens): forward "
        f"{g['forward_ms']:.1f} ms, globenc+alti+rollouts {g['methods_ms']:.1f} ms -> ratio "
        f"{g['ratio_methods']:.2f} (with the traced forward: {g['ratio_with_trace']:.2f})"
    )
    v = value_zeroing_ratio(lens, enc, args.repeats)
    print(
        f"(2) value zeroing: {v['value_zeroing_s']:.2f} s vs n={v['tokens']} x {v['layer_passes_ms']:.1f} ms "
        f"(one pass through every layer) -> ratio {v['ratio']:.2f}"
    )
    out = subprocess.run([sys.executable, __file__, "--decompx-child"], capture_output=True, text=True, check=True)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"(3) DecompX, one 256-token input: peak RSS {d['rss_gib']:.2f} GiB, {d['wall_s']:.1f} s, "
        f"relative logit error {d['rel_error']:.1e}"
    )
    flow_enc = lens.encode([text_of(lens, FLOW_MAX_TOKENS)])
    flow_s = timed(lambda: get("attention_flow")(lens.trace(flow_enc)))
    print(f"(4) attention_flow, one {FLOW_MAX_TOKENS}-token input: {flow_s:.1f} s")
    print(
        json.dumps(
            {
                "globenc_alti_ratio": round(g["ratio_methods"], 3),
                "globenc_alti_ratio_with_trace": round(g["ratio_with_trace"], 3),
                "value_zeroing_ratio": round(v["ratio"], 3),
                "decompx_256_rss_gib": round(d["rss_gib"], 3),
                "decompx_256_s": round(d["wall_s"], 2),
                "flow_s": round(flow_s, 2),
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
