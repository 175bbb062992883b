"""Reproduction on SST-2 dev with the bundled all-MiniLM-L6-v2 (6 layers, 12 heads):

1. Brunner et al. (2020): median share of a token's own input in its last-layer representation, i.e. the HTA
   diagonal c^L_ii (they report 7.5 % for bert-base, 12 layers).
2. Pascual et al. (2021): per-layer mean Jensen–Shannon divergence between attention rows and head-attribution rows.

Exact HTA costs n·d JVPs per sentence; on a 2-core machine the default is the Hutchinson estimate (k probes,
standard error reported) on the first `--limit` sentences. Run: python experiments/brunner_pascual.py --limit 96
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

import mixlens
from mixlens.corpus.readers import iter_examples
from mixlens.methods import gradients as G
from mixlens.methods.attention import stacked_alpha
from mixlens.stats.agreement import js_rows

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "dev.tsv"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--limit", type=int, default=96, help="first N sentences (0 = all 872)")
    ap.add_argument("--mode", default="estimate", choices=G.MODES)
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    lens = mixlens.load()
    texts = [ex.text for ex in iter_examples(args.data, text_column="sentence")]
    texts = texts[: args.limit] if args.limit > 0 else texts
    order = sorted(range(len(texts)), key=lambda k: len(texts[k]))  # similar lengths per batch: less padding
    diag_all, diag_words, rel_se = [], [], []
    js_sum = js_cnt = 0
    t0 = time.perf_counter()
    for start in range(0, len(order), args.batch_size):
        batch = [texts[k] for k in order[start : start + args.batch_size]]
        tr = lens.trace(batch)
        jn = G.jacobian_norms(tr, mode=args.mode, probes=args.probes)
        c, se = G.shares(jn.hidden, jn.hidden_se)  # [B, L, n, n]
        glob, _ = G.shares(jn.heads)  # [B, L, H, n, n]
        mask = tr.mask
        ids = tr.inputs["input_ids"]
        special = torch.isin(ids, torch.tensor([lens.tokenizer.cls_token_id, lens.tokenizer.sep_token_id]))
        last = c[:, -1].diagonal(dim1=-2, dim2=-1)  # [B, n]
        diag_all.append(last[mask])
        diag_words.append(last[mask & ~special])
        if se is not None:
            rel_se.append((se[:, -1].diagonal(dim1=-2, dim2=-1) / last.clamp_min(1e-12))[mask])
        js = js_rows(stacked_alpha(tr), glob, mask)  # [B, L, H, n]
        w = mask.float()[:, None, None, :]
        js_sum = js_sum + (js * w).sum((0, 2, 3))
        js_cnt += float(w.sum()) * js.shape[2]
        print(f"{start + len(batch)}/{len(order)} sentences, {time.perf_counter() - t0:.0f} s", flush=True)
    diag_all, diag_words = torch.cat(diag_all), torch.cat(diag_words)
    print(f"\nSST-2 dev: {len(texts)} sentences, {diag_all.numel()} tokens; mode={args.mode}"
          + (f", k={args.probes} probes" if args.mode == "estimate" else ""))
    print(f"median HTA diagonal share at the last layer: {100 * diag_all.median():.1f} % (all tokens), "
          f"{100 * diag_words.median():.1f} % (without [CLS]/[SEP]); mean {100 * diag_all.mean():.1f} %")
    if rel_se:
        print(f"median relative standard error of those shares: {100 * torch.cat(rel_se).median():.1f} %")
    js_layer = (js_sum / js_cnt).numpy()
    print("mean JS divergence (base 2) between attention and head attribution, per layer:")
    print("  " + "  ".join(f"L{k}: {v:.3f}" for k, v in enumerate(js_layer)) + f"  | mean {np.mean(js_layer):.3f}")
    print(f"time: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
