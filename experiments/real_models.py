"""Kobayashi (2021) mixing ratios and the position-0 "attention sink" on the real checkpoints of
scripts/fetch_models.py, over the first N sentences of SST-2 dev (`--data`, GLUE's SST-2 dev.tsv).

    python experiments/real_models.py [--n 64] [--data data/sst2/dev.tsv] [NAME ...]

Prints, per model, the mixing ratios r_i (%, mean over the real tokens of every layer, then over layers) of the five
variants and, per layer, W / N / Res-N / ResLN-N; for the decoders also the mean over targets i ≥ 1 of the head-mean
α_i0 (weights) beside the N-norm share ‖u_i0‖ / Σ_j ‖u_ij‖ of position 0.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import torch

import mixlens
from mixlens.methods.norms import RATIO_VARIANTS, block_norms

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "sst2" / "dev.tsv"
NAMES = ("all-mpnet-base-v2", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m")


def sentences(n: int, data: Path = DATA) -> list[str]:
    with data.open() as f:
        return [row["sentence"].strip() for _, row in zip(range(n), csv.DictReader(f, delimiter="\t"), strict=False)]


@torch.no_grad()
def measure(lens: mixlens.Lens, texts: list[str], batch: int = 16) -> dict[str, torch.Tensor]:
    """Per-layer sums over real tokens: ratio [5, L], and for position 0: α share and N share [2, L]; token count."""
    n_layers = lens.adapter.n_layers
    ratio_sum, sink_sum = torch.zeros(len(RATIO_VARIANTS), n_layers), torch.zeros(2, n_layers)
    tokens = targets = 0
    for s in range(0, len(texts), batch):
        tr = lens.trace(lens.encode(texts[s : s + batch]), to_output=False)
        bn = block_norms(tr)
        m = tr.mask.float()  # [B, n]
        ratio_sum += torch.stack([(bn.ratio[v] * m[:, None]).sum((0, 2)) for v in RATIO_VARIANTS])
        tokens += int(m.sum())
        t_mask = m.clone()
        t_mask[:, 0] = 0  # targets i ≥ 1 (position 0 attends only to itself in a decoder)
        alpha0 = torch.stack([lt.alpha.float().mean(1)[..., 0] for lt in tr.layers], 1)  # [B, L, n]
        n_share = bn.n[..., 0] / bn.n.sum(-1).clamp_min(1e-30)  # [B, L, n]
        sink_sum += torch.stack([(alpha0 * t_mask[:, None]).sum((0, 2)), (n_share * t_mask[:, None]).sum((0, 2))])
        targets += int(t_mask.sum())
    return {"ratio": ratio_sum / tokens, "sink": sink_sum / targets}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=list(NAMES))
    ap.add_argument("--n", type=int, default=64, help="first N sentences of SST-2 dev")
    ap.add_argument("--data", type=Path, default=DATA, help="GLUE's SST-2 dev.tsv")
    args = ap.parse_args()
    root = Path(os.environ.get("MIXLENS_MODELS", Path.home() / ".cache" / "mixlens" / "models")).expanduser()
    texts = sentences(args.n, args.data)
    for name in args.names:
        if not (root / name / "config.json").is_file():
            print(f"{name}: not fetched, skipped", file=sys.stderr)
            continue
        lens = mixlens.load(root / name, head="base")
        res = measure(lens, texts)
        mean = res["ratio"].mean(1) * 100
        first = lens.encode([texts[0]]).tokens[0][0]
        print(f"\n## {name} ({lens.adapter.family.name}, {lens.adapter.n_layers} layers; SST-2 dev first {args.n}; "
              f"position 0 = {first!r})")
        print("mean ratios %: " + ", ".join(f"{v} {x:.1f}" for v, x in zip(RATIO_VARIANTS, mean.tolist(), strict=True)))
        print("layer |   W  |   N  | Res-N | ResLN-N | α to pos 0 | N share of pos 0")
        for i in range(lens.adapter.n_layers):
            r, k = res["ratio"][:, i] * 100, res["sink"][:, i] * 100
            print(f"{i:5d} | {r[0]:4.1f} | {r[1]:4.1f} | {r[3]:5.1f} | {r[4]:7.1f} | {k[0]:10.1f} | {k[1]:16.1f}")
        k = res["sink"].mean(1) * 100
        print(f"mean  | position 0: α {k[0]:.1f} %, N share {k[1]:.1f} % (targets i ≥ 1)")


if __name__ == "__main__":
    main()
