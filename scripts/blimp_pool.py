"""Developer script: pooled evidence alignment (MRR) per method from `mixlens evaluate --task blimp` runs.

    python scripts/blimp_pool.py out/blimp-a/evaluation.json [out/blimp-b/evaluation.json ...] [--seed 0]
        [--paradigms] [--same-as out/blimp-slow/evaluation.json]

Reads every example of the given evaluation.json files (e.g. runs over other `--skip` ranges of the same
paradigms), recomputes each method's reciprocal rank of the evidence from the stored scores (the definition of
`mixlens.explain.evidence.reciprocal_rank`), and prints per method the MRR over all prompts and over the prompts
whose evidence is not the first token (where an attention sink at position 0 ranks it first for free) and over
those whose evidence is neither the first nor the last token (the predicting position itself, which a method that
keeps a token's own stream ranks first for free), each with a 95 % bootstrap interval (1,000 resamples);
The last column splits the MRR by whether the model prefers the target (logit difference f > 0) or not.
`--paradigms` adds the MRR of each method per paradigm with its interval (a markdown table, paradigms in rows).
`--same-as FILE` keeps only the prompts that FILE holds (e.g. a slower run over fewer prompts per paradigm), so
that every method is compared over the same prompts.
A method missing from some runs is pooled over the runs that have it (n says how many prompts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from mixlens.explain.evidence import reciprocal_rank


def _key(ex: dict) -> tuple:
    c = ex["contrast"]
    return c["group"], ex["text"], c["target_id"], c["foil_id"]


def interval(values: list[float], rng: np.random.Generator) -> str:
    v = np.asarray(values, float)
    boots = rng.choice(v, (1000, len(v))).mean(1)
    return f"{v.mean():.2f} [{np.percentile(boots, 2.5):.2f}, {np.percentile(boots, 97.5):.2f}] (n={len(v)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paradigms", action="store_true", help="also the MRR per paradigm and method")
    ap.add_argument("--same-as", help="an evaluation.json: keep only the prompts it holds")
    args = ap.parse_args()
    keep = None
    if args.same_as:
        with Path(args.same_as).open(encoding="utf-8") as fh:
            keep = {_key(ex) for ex in json.load(fh)["examples"]}
    ranks: dict[str, list[tuple[bool, bool, float]]] = {}
    right: dict[str, list[tuple[bool, float]]] = {}
    by_group: dict[str, dict[str, list[float]]] = {}
    for path in args.files:
        with Path(path).open(encoding="utf-8") as fh:
            run = json.load(fh)
        for ex in run["examples"]:
            if keep is not None and _key(ex) not in keep:
                continue
            evidence = ex["contrast"]["evidence"]
            special = np.asarray(ex["special"], bool)
            for method, scores in ex["scores"].items():
                rr = reciprocal_rank(np.asarray(scores, float), special, evidence)
                last = len(ex["tokens"]) - 1
                ranks.setdefault(method, []).append((0 in evidence, last in evidence, rr))
                right.setdefault(method, []).append((ex["f"] > 0, rr))
                by_group.setdefault(ex["contrast"]["group"], {}).setdefault(method, []).append(rr)
    rng = np.random.default_rng(args.seed)
    print(
        "method | MRR, all prompts | MRR, evidence not the first token | MRR, neither the first nor the last | "
        "MRR✓ / MRR✗"
    )
    for method, rows in sorted(ranks.items(), key=lambda kv: -np.mean([r for *_, r in kv[1]])):
        later = [r for first, _, r in rows if not first]
        inner = [r for first, last, r in rows if not first and not last]
        cells = [interval(v, rng) if v else "-" for v in ([r for *_, r in rows], later, inner)]
        ok = [r for good, r in right[method] if good]
        bad = [r for good, r in right[method] if not good]
        cells.append(" / ".join(f"{np.mean(v):.2f}" if v else "-" for v in (ok, bad)))
        print(f"{method} | " + " | ".join(cells))
    if args.paradigms:
        order = sorted(ranks, key=lambda m: -np.mean([r for *_, r in ranks[m]]))
        print("\nparadigm | n | " + " | ".join(order))
        print("--- | --: | " + " | ".join("---" for _ in order))
        for group, per in sorted(by_group.items()):
            cells = []
            for m in order:
                v = np.asarray(per.get(m, []), float)
                if not len(v):
                    cells.append("-")
                    continue
                boots = rng.choice(v, (1000, len(v))).mean(1)
                cells.append(f"{v.mean():.2f} [{np.percentile(boots, 2.5):.2f}, {np.percentile(boots, 97.5):.2f}]")
            print(f"{group} | {max(len(x) for x in per.values())} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
