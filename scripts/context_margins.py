"""How clearly each method singles out the gold passage, beyond its rank: from `evaluate --task context` runs.

Rank and MRR saturate once a method ranks the gold passage first on every prompt; they cannot show a signal that
weakens with length while staying first. This script reads the runs' evaluation.json files and, for each method and
each scored prompt, takes the passage scores summed over the answer tokens (s_1 … s_N, the numbers the ranks come
from) and reports

    share   s_gold / Σ_p |s_p|: 1 when all of the attribution is on the gold passage, 0 or below when none is;
    margin  (s_gold − max over the other passages of s_p) / Σ_p |s_p|: > 0 exactly when the gold passage is first.

as the mean over the scored prompts with a 95 % bootstrap interval (2,000 resamples of the prompts, seed 0).
Leave-one-passage-out's scores are the drops of the answer's log-probability, treated the same way.

    python scripts/context_margins.py runs/qwen-1k/evaluation.json runs/qwen-4k/evaluation.json ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def summed(scores: list[list[float]] | list[float]) -> np.ndarray:
    """Passage scores [answer token, passage] (or already [passage]) summed over the answer: [passage]."""
    a = np.asarray(scores, dtype=float)
    return a.sum(0) if a.ndim == 2 else a


def measures(s: np.ndarray, gold: int) -> tuple[float, float]:
    total = float(np.abs(s).sum())
    if total == 0.0:
        return 0.0, 0.0
    other = np.delete(s, gold)
    return float(s[gold]) / total, float(s[gold] - other.max()) / total


def interval(xs: np.ndarray, rng: np.random.Generator, n: int = 2000) -> tuple[float, float]:
    if len(xs) < 2:
        return float(xs.mean()), float(xs.mean())
    means = xs[rng.integers(0, len(xs), (n, len(xs)))].mean(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="evaluation.json files of evaluate --task context")
    args = ap.parse_args()
    print("| run | method | scored | share [95 %] | margin [95 %] | min margin |")
    print("| --- | --- | ---: | --- | --- | ---: |")
    for path in args.runs:
        ev = json.loads(path.read_text())
        scored = [e for e in ev["examples"] if e.get("correct")]
        methods = list(dict.fromkeys(m for e in scored for m in e["passage_scores"]))
        methods += ["leave_one_out"] if any(e.get("leave_one_out") for e in scored) else []
        for m in methods:  # each over the scored prompts it ran on
            rows = []
            for e in scored:
                s = e.get("leave_one_out") if m == "leave_one_out" else e["passage_scores"].get(m)
                if s:
                    rows.append(measures(summed(s), int(e["gold"])))
            share, margin = (np.array(x) for x in zip(*rows, strict=True))
            rng = np.random.default_rng(0)
            lo, hi = interval(share, rng)
            mlo, mhi = interval(margin, rng)
            print(f"| {path.parent.name} | {m} | {len(rows)} | {share.mean():.2f} [{lo:.2f}, {hi:.2f}] | "
                  f"{margin.mean():.2f} [{mlo:.2f}, {mhi:.2f}] | {margin.min():.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
