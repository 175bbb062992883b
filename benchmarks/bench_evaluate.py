"""Benchmark and real run of `mixlens evaluate`: the evaluation's own cost vs attributions and perturbed forwards.

    PYTHONPATH=src python benchmarks/bench_evaluate.py --model artifacts/sst2-minilm --skip 600 --limit 272 \
        --out out/eval-sst2

Evaluates in chunks of `--chunk` sentences and rewrites DIR/evaluation.json (and the figure) after each chunk, so
a long run can be stopped and still reports every finished example. Prints the time per method, the perturbed
forward passes, and the evaluation's own cost (everything else) as a share of the total.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import mixlens
from mixlens.corpus.readers import iter_examples
from mixlens.explain.evaluate import Evaluation, evaluate
from mixlens.result import atomic_write
from mixlens.viz.evaluation import plot

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "dev.tsv"


def merge(parts: list[Evaluation]) -> Evaluation:
    timings: dict[str, float] = {}
    for p in parts:
        for k, v in p.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    first = parts[0]
    return Evaluation(first.model, first.version, first.removal, first.methods,
                      [e for p in parts for e in p.examples], first.seed, timings, first.notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--skip", type=int, default=600)
    ap.add_argument("--limit", type=int, default=272)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--removal", default="delete")
    ap.add_argument("--method", action="append", default=None)
    ap.add_argument("--out", type=Path, default=Path("out/eval-sst2"))
    args = ap.parse_args()
    texts = [ex.text for ex in itertools.islice(iter_examples(args.data, "sentence"), args.skip,
                                                args.skip + args.limit)]
    lens = mixlens.load(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    parts: list[Evaluation] = []
    start = time.perf_counter()
    for s in range(0, len(texts), args.chunk):
        parts.append(evaluate(lens, texts[s : s + args.chunk], args.method, removal=args.removal))
        ev = merge(parts)
        atomic_write(args.out / "evaluation.json", ev.dumps().encode())
        t = ev.timings
        print(f"{len(ev.examples)}/{len(texts)} examples, {time.perf_counter() - start:.0f} s; own cost "
              f"{t['own']:.1f} s of {t['total']:.1f} s ({100 * t['own'] / t['total']:.1f} %)", flush=True)
    plot(ev, args.out / "evaluation.png")
    met = ev.metrics()
    print(f"{'method':24s} {'AOPC':>7s} {'comp':>7s} {'suff':>7s} {'ρ G×I':>7s} {'time s':>8s}")
    for m in ev.ranking():
        r = met[m]
        print(f"{m:24s} {r['aopc']:7.3f} {r['comprehensiveness']:7.3f} {r['sufficiency']:7.3f} "
              f"{r['spearman_gxi']:7.3f} {ev.timings.get(m, 0.0):8.1f}")
    t = ev.timings
    print(f"total {t['total']:.1f} s: attributions {t['attributions']:.1f} s, perturbed forwards {t['forward']:.1f} s, "
          f"own {t['own']:.1f} s ({100 * t['own'] / t['total']:.1f} %)")


if __name__ == "__main__":
    main()
