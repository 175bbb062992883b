#!/usr/bin/env bash
# Full-data runs of docs/guides/bertology.md §5, §5a and §10: the bundled model on all 1,500 STS-B dev pairs — the uniform
# sweep (timed: benchmarks/bench_sweep.py), the zero sweep, the pruning study, mixing vs. disabling (from the two
# sweeps) — and their figures copied into docs/figures/. About 20 min on a quiet 2-core machine.
#
#     experiments/bertology_full_data.sh [OUT]        # default OUT: out/bertology-full (git-ignored)
#
# Run from the repository root with the virtual environment active (`python` and `mixlens` on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/bertology-full}
DATA=../shared/data/stsb/dev.tsv
python benchmarks/bench_sweep.py --data "$DATA" --batch-size 64 --out "$OUT/sweep-uniform"
mixlens sweep -d "$DATA" --mode zero --batch-size 64 -o "$OUT/sweep-zero"
mixlens prune -d "$DATA" --held-out 0.5 --seed 0 --batch-size 64 -o "$OUT/prune" --save "$OUT/pruned"
python experiments/mixing_disabling.py --data "$DATA" --limit 0 --batch-size 64 --out "$OUT/mixing-disabling" \
    --sweep uniform="$OUT/sweep-uniform/sweep.csv" --sweep zero="$OUT/sweep-zero/sweep.csv"
cp "$OUT/sweep-uniform/sweep.png" docs/figures/sweep_uniform.png
cp "$OUT/sweep-zero/sweep.png" docs/figures/sweep_zero.png
cp "$OUT/mixing-disabling/mixing_disabling.png" docs/figures/mixing_disabling.png
echo "wrote $OUT and docs/figures/{sweep_uniform,sweep_zero,mixing_disabling}.png" >&2
