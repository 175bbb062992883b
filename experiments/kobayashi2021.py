"""Reproduce Kobayashi et al. (2021), Table 1 style: mean context-mixing ratio of W, N, Res-W, Res-N, ResLN-N.

Over SST-2 dev, with 12 % of the non-special tokens of each sentence replaced by the mask token (seed 0), mean
over every real token (special tokens included) and every layer, printed beside the paper's bert-base-uncased
figures (Wikipedia, 12 % masked). Also: per-layer means, the Spearman correlation of per-token ResLN-N ratio
with word-frequency rank (frequency counted over the same corpus), and the expansion rate of f per layer.

    python experiments/kobayashi2021.py [--model DIR] [--data path/to/sst2/dev.tsv] [--limit N]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
import torch

import mixlens
from mixlens.lens import Encoded
from mixlens.methods.norms import RATIO_VARIANTS, block_norms
from mixlens.stats.mixing import expansion_rate, frequency_rank_correlation

PAPER_BERT_BASE = {"W": 97.1, "N": 85.2, "Res-W": 48.6, "Res-N": 22.3, "ResLN-N": 18.8}
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "dev.tsv"


def masked_batch(lens: mixlens.Lens, texts: list[str], rate: float, rng: np.random.Generator) -> Encoded:
    """Tokenize and replace `rate` of the non-special tokens of each input by the mask token."""
    enc = lens.encode(texts)
    ids = enc.inputs["input_ids"].clone()
    for b in range(len(texts)):
        n = len(enc.tokens[b])
        roles = lens.special_roles(ids[b, :n].tolist())
        cand = [k for k in range(n) if roles[k] is None]
        k = int(round(rate * len(cand)))
        for pos in rng.choice(cand, size=k, replace=False):
            ids[b, pos] = lens.tokenizer.mask_token_id
        enc.tokens[b] = lens.tokenizer.convert_ids_to_tokens(ids[b, :n].tolist())
    enc.inputs["input_ids"] = ids
    return enc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--mask-rate", type=float, default=0.12)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    if not args.data.is_file():
        raise SystemExit(f"data file {args.data} not found (GLUE's SST-2 dev.tsv; pass it with --data)")
    with args.data.open(newline="") as fh:
        texts = [r["sentence"].strip() for r in csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)]
    texts = texts[: args.limit] if args.limit else texts
    lens = mixlens.load(args.model)
    rng = np.random.default_rng(0)
    sums = {v: None for v in RATIO_VARIANTS}
    count, max_err = 0, 0.0
    per_token, tokens = [], []
    for start in range(0, len(texts), args.batch_size):
        enc = masked_batch(lens, texts[start : start + args.batch_size], args.mask_rate, rng)
        bn = block_norms(lens.trace(enc))
        max_err = max(max_err, bn.error.max().item())
        for v in RATIO_VARIANTS:
            s = bn.ratio[v].sum((0, 2))  # [layer], padding is 0
            sums[v] = s if sums[v] is None else sums[v] + s
        count += int(enc.inputs["attention_mask"].sum())
        per_token += [r[:, : len(t)].numpy() for r, t in zip(bn.ratio["ResLN-N"], enc.tokens, strict=True)]
        tokens += enc.tokens
    layer_means = {v: (100 * sums[v] / count).numpy() for v in RATIO_VARIANTS}
    print(f"model: {lens.name}   inputs: {len(texts)} SST-2 dev sentences   tokens: {count}   "
          f"masked: {100 * args.mask_rate:.0f}% (seed 0)   max reconstruction error: {max_err:.2e}")
    print(f"{'variant':8s} {'mixlens %':>10s} {'paper bert-base %':>18s}   per layer")
    for v in RATIO_VARIANTS:
        per_layer = " ".join(f"{x:5.1f}" for x in layer_means[v])
        print(f"{v:8s} {layer_means[v].mean():10.1f} {PAPER_BERT_BASE[v]:18.1f}   {per_layer}")
    n = max(len(t) for t in tokens)
    padded = np.stack([np.pad(r, ((0, 0), (0, n - r.shape[1]))) for r in per_token])
    rho = frequency_rank_correlation(padded, tokens)
    print("Spearman ρ(ResLN-N ratio, frequency rank) per layer: " + " ".join(f"{x:+.2f}" for x in rho))
    rate = expansion_rate(lens.adapter)
    print("expansion rate of f, mean over heads per layer: " + " ".join(f"{x:.2f}" for x in rate.mean(1)))


if __name__ == "__main__":
    with torch.no_grad():
        main()
