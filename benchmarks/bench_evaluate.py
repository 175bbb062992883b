"""Benchmark and real run of `mixlens evaluate`: the evaluation's own cost vs attributions and perturbed forwards.

    PYTHONPATH=src python benchmarks/bench_evaluate.py --model artifacts/sst2-minilm --skip 600 --limit 272 \\
        --removal delete --removal mask --out out/eval-sst2

Evaluates in chunks of `--chunk` inputs and rewrites DIR/evaluation.json (DIR/REMOVAL/evaluation.json for
several removals; the attributions are computed once and shared) after each chunk, so a long run can be stopped and
still reports every finished example; `--resume` continues from the saved examples. `--report` computes nothing
and reports saved runs (`--part DIR`, repeatable: runs over consecutive slices of the inputs, merged into --out;
`--first N`: the first N examples only). Prints the time per method,
the perturbed forward passes and the evaluation's own cost (everything else) as a share of the total; the split is
also in the JSON (`timings`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import time
from pathlib import Path

import torch

import mixlens
from mixlens.corpus.readers import iter_examples
from mixlens.explain.evaluate import Evaluation, evaluate_removals
from mixlens.result import atomic_write
from mixlens.viz.evaluation import plot

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "dev.tsv"
WORDS = (6, 25)  # sentence length range of the next-word prefixes, in whitespace-separated words
FINAL_WORD = re.compile(r"^(.*\S)\s+([A-Za-z]+)[.!?'\")]*$")


def conllu_prefixes(path: Path) -> list[str]:
    """Next-word prompts from a CoNLL-U file's `# text =` lines: each sentence of WORDS[0]..WORDS[1] words whose
    last word is alphabetic (before any final punctuation), cut before that word (`--data X.conllu`)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("# text = "):
            continue
        text = line[len("# text = ") :].strip()
        m = FINAL_WORD.match(text)
        if m and WORDS[0] <= len(text.split()) <= WORDS[1]:
            out.append(m.group(1))
    return out


def merge(parts: list[Evaluation]) -> Evaluation:
    """One Evaluation from consecutive chunks (timings summed)."""
    timings: dict[str, float] = {}
    for p in parts:
        for k, v in p.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    first = parts[0]
    examples = [e for p in parts for e in p.examples]
    return Evaluation(first.model, first.version, first.removal, first.methods, examples, first.seed, timings,
                      first.notes)


def consecutive(parts: list[Evaluation]) -> list[Evaluation]:
    """Runs over consecutive slices of the inputs, each cut where the next one begins (a run stopped after passing
    the next slice's start); the timings of a cut run are scaled by the share of its examples kept."""
    out = []
    for part, nxt in zip(parts, [*parts[1:], None], strict=True):
        texts = [e.text for e in part.examples]
        stop = texts.index(nxt.examples[0].text) if nxt is not None and nxt.examples[0].text in texts else len(texts)
        share = stop / len(texts)
        out.append(Evaluation(part.model, part.version, part.removal, part.methods, part.examples[:stop], part.seed,
                              {k: v * share for k, v in part.timings.items()}, part.notes))
    return out


def markdown(ev: Evaluation, timed: int) -> str:
    """The ranked table of docs/findings/evaluate.md: each metric's mean [95 % interval], attribution seconds per
    example (the timings are those of the first `timed` examples)."""
    met, n = ev.metrics(), timed
    rows = ["| method | AOPC | comprehensiveness | sufficiency ↓ | Spearman with ‖G×I‖ | attribution s/example |",
            "|---|---|---|---|---|---|"]
    for m in ev.ranking():
        r = met[m]
        cells = [f"{r[k]:.3f} [{r['ci95'][k][0]:.3f}, {r['ci95'][k][1]:.3f}]"
                 for k in ("aopc", "comprehensiveness", "sufficiency", "spearman_gxi")]
        rows.append(f"| `{m}` | {' | '.join(cells)} | {ev.timings.get(m, 0.0) / n:.2f} |")
    return "\n".join(rows)


def report(ev: Evaluation, timed: int) -> None:
    met, t, n = ev.metrics(), ev.timings, timed
    print(f"\n{ev.removal}: {len(ev.examples)} examples, ranked by AOPC (timings: {n} examples)")
    print(f"{'method':22s} {'AOPC':>7s} {'comp':>7s} {'suff':>7s} {'ρ G×I':>7s} {'s/example':>10s}")
    for m in ev.ranking():
        r = met[m]
        print(f"{m:22s} {r['aopc']:7.3f} {r['comprehensiveness']:7.3f} {r['sufficiency']:7.3f} "
              f"{r['spearman_gxi']:7.3f} {t.get(m, 0.0) / n:10.3f}")
    print(f"total {t['total']:.1f} s: attributions {t['attributions']:.1f} s, perturbed forwards {t['forward']:.1f} s, "
          f"evaluation's own {t['own']:.1f} s ({100 * t['own'] / t['total']:.1f} % of the total)")
    for note in ev.notes:
        print(f"note: {note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--text-column", default="sentence")
    ap.add_argument("--skip", type=int, default=600)
    ap.add_argument("--limit", type=int, default=272)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--removal", action="append", default=None, help="delete and/or mask (repeatable)")
    ap.add_argument("--method", action="append", default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--resume", action="store_true", help="continue from the examples saved in --out")
    ap.add_argument("--out", type=Path, default=Path("out/eval-sst2"))
    ap.add_argument("--report", action="store_true", help="compute nothing: report the saved run(s) in --out")
    ap.add_argument("--first", type=int, default=0, help="with --report: only the first N saved examples")
    ap.add_argument("--dpi", type=int, default=200, help="resolution of the figure")
    ap.add_argument("--part", type=Path, action="append", default=[],
                    help="with --report: saved runs over consecutive inputs (repeatable, in order), merged into --out")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    removals = args.removal or ["delete"]
    dirs = {r: args.out / r if len(removals) > 1 else args.out for r in removals}
    if args.report:
        for r, d in dirs.items():
            if args.part:
                sub = r if len(removals) > 1 else "."
                ev = merge(consecutive([Evaluation.from_json(json.loads((p / sub / "evaluation.json").read_text()))
                                        for p in args.part]))
                d.mkdir(parents=True, exist_ok=True)
                atomic_write(d / "evaluation.json", ev.dumps().encode())
            else:
                ev = Evaluation.from_json(json.loads((d / "evaluation.json").read_text()))
            timed = len(ev.examples)
            if args.first:
                ev.examples = ev.examples[: args.first]
            plot(ev, d / "evaluation.png", dpi=args.dpi)
            report(ev, timed)
            print(markdown(ev, timed))
        return
    if args.data.suffix == ".conllu":
        texts = conllu_prefixes(args.data)[args.skip : args.skip + args.limit]
    else:
        rows = iter_examples(args.data, args.text_column)
        texts = [ex.text for ex in itertools.islice(rows, args.skip, args.skip + args.limit)]
    lens = mixlens.load(args.model)
    parts: dict[str, list[Evaluation]] = {r: [] for r in removals}
    if args.resume and all((d / "evaluation.json").is_file() for d in dirs.values()):
        for r, d in dirs.items():
            parts[r].append(Evaluation.from_json(json.loads((d / "evaluation.json").read_text())))
        done = min(len(p[0].examples) for p in parts.values())
        for r in removals:
            p = parts[r][0]
            p.examples = p.examples[:done]
            assert [e.text for e in p.examples] == texts[:done], "--resume: the saved run has other inputs"
        print(f"resuming after {done} examples", flush=True)
    else:
        done = 0
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for s in range(done, len(texts), args.chunk):
        res = evaluate_removals(lens, texts[s : s + args.chunk], args.method, removals=removals,
                                batch_size=args.batch_size)
        for r in removals:
            parts[r].append(res[r])
            ev = merge(parts[r])
            atomic_write(dirs[r] / "evaluation.json", ev.dumps().encode())
            t = ev.timings
            print(f"{r}: {len(ev.examples)}/{len(texts)} examples, {time.perf_counter() - start:.0f} s; own cost "
                  f"{t['own']:.1f} s of {t['total']:.1f} s ({100 * t['own'] / t['total']:.1f} %)", flush=True)
    for r in removals:
        ev = merge(parts[r])
        plot(ev, dirs[r] / "evaluation.png")
        report(ev, len(ev.examples))


if __name__ == "__main__":
    main()
