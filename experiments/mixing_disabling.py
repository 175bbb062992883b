"""Mixing explains disabling? Per layer the ResLN-N mixing ratio beside the STS-B cost of disabling that
layer's attention (uniform and zero), per head the share of the attention output norm beside the cost of
disabling that head; Spearman ρ over layers and over heads (docs/guides/bertology.md §10).

    python experiments/mixing_disabling.py [--model DIR] [--limit 0] [--out DIR] [--sweep uniform=DIR/sweep.csv ...]

`--sweep MODE=CSV` takes that mode's harms from a finished `mixlens sweep --mode MODE` on the same pairs and batch
size instead of running the sweep again.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import mixlens
from mixlens.bertology.mixing_disabling import mixing_disabling_figure, mixing_vs_disabling
from mixlens.bertology.sweep import read_sweep_csv
from mixlens.bertology.tasks import StsTask

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb" / "dev.tsv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--limit", type=int, default=0, help="first N pairs (0 = all)")
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("mixing-disabling"))
    ap.add_argument("--sweep", action="append", default=[], metavar="MODE=CSV",
                    help="a finished `mixlens sweep` of that mode on the same data (repeatable)")
    args = ap.parse_args()
    with args.data.open(newline="") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    rows = rows[: args.limit] if args.limit else rows
    pairs = [(r["sentence1"], r["sentence2"]) for r in rows]
    lens = mixlens.load(args.model)
    task = StsTask(lens, pairs, [float(r["score"]) for r in rows], args.batch_size)
    done = {m: read_sweep_csv(f, m, len(pairs)) for m, f in (item.split("=", 1) for item in args.sweep)}
    rep = mixing_vs_disabling(lens, task, [s for p in pairs for s in p], batch_size=args.batch_size, done=done)
    print(f"{lens.name}, {len(pairs)} STS-B dev pairs; baseline Spearman {rep.baseline:.4f}")
    print("layer  ratio%  " + "  ".join(f"harm_{m}" for m in rep.layer_harm))
    for layer, r in enumerate(rep.ratio):
        print(f"{layer:5d}  {100 * r:6.1f}  " + "  ".join(f"{rep.layer_harm[m][layer]:+.4f}" for m in rep.layer_harm))
    for m in rep.layer_harm:
        print(f"{m}: ρ over layers {rep.rho_layers[m]:+.3f}, over heads {rep.rho_heads[m]:+.3f}")
    mixing_disabling_figure(rep, args.out / "mixing_disabling.png",
                            f"Mixing vs. disabling — {lens.name}, {len(pairs)} STS-B dev pairs")


if __name__ == "__main__":
    main()
