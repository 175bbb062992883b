"""Corpus throughput: examples/s of a whole `run_corpus` with the norm family (norm, norm_res, norm_resln,
plus mixing ratios, entropies, token-type masses, Parquet shards, manifest) over SST-2 dev on the bundled
model, against plain forward passes (tokenize + model forward, no hooks) over the same batches, in one run.

Runs are interleaved and the median of `--repeats` is reported; the target is ratio ≥ 0.70.

`--ray-data` instead times the Ray Data backend against the local backend on the same corpus (Ray's own overhead;
target ≥ 0.90 with one actor per core) and its scaling from 1 to 2 actors, in one run on a local Ray. Each run is
reported whole (wall clock, model loading by the actors included) and in steady state (examples per second between
the first and the last shard file written), and the per-actor steady rate gives what N actors would take on a
one-million-sentence corpus.

    python benchmarks/bench_corpus.py [--repeats 3] [--limit 872] [--batch-size 32]
    python benchmarks/bench_corpus.py --ray-data [--limit 872] [--shard-size 64] [--copies 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import mixlens
from mixlens.corpus import iter_examples
from mixlens.corpus.runner import run_corpus
from mixlens.pipeline import run_methods

SST2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "dev.tsv"
METHODS = ["norm", "norm_res", "norm_resln"]


def planned_batches(lens: mixlens.Lens, texts: list[str], batch_size: int, max_tokens: int, shard_size: int,
                    methods: list[str] | None = None):
    """The corpus runner's own batches (same shards, same sort), each tokenized once; traced for `methods`."""
    for s in range(0, len(texts), shard_size):
        yield from lens.batches(texts[s : s + shard_size], batch_size, order="length", max_tokens=max_tokens,
                                trace=methods or False)


def forward_only(lens: mixlens.Lens, texts: list[str], batch_size: int, max_tokens: int, shard_size: int) -> float:
    """Seconds for tokenize + plain forward over the corpus runner's own batches."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for bt in planned_batches(lens, texts, batch_size, max_tokens, shard_size):
            lens.model(**bt.enc.inputs)
    return time.perf_counter() - t0


def engine_only(lens: mixlens.Lens, texts: list[str], batch_size: int, max_tokens: int, shard_size: int) -> float:
    """Seconds for tokenize + traced forward + the norm family (`run_methods`) on the same batches, without the
    corpus machinery (reading, statistics, Parquet, manifest): separates the runner's overhead from the engine's."""
    t0 = time.perf_counter()
    for bt in planned_batches(lens, texts, batch_size, max_tokens, shard_size, METHODS):
        run_methods(bt.trace, METHODS)
    return time.perf_counter() - t0


def corpus(lens: mixlens.Lens, data: Path, out: Path, batch_size: int, max_tokens: int, shard_size: int) -> float:
    t0 = time.perf_counter()
    run_corpus(data, out, METHODS, lens=lens, batch_size=batch_size, max_tokens=max_tokens, shard_size=shard_size,
               overwrite=True)
    return time.perf_counter() - t0


def steady_rate(out: Path) -> float:
    """Examples per second between the first and the last shard file written (the run's steady state)."""
    shards = json.loads((out / "manifest.json").read_text())["shards"]
    times = sorted(((out / s["file"]).stat().st_mtime, s["examples"]) for s in shards)
    if len(times) < 2:
        return float("nan")
    return sum(n for _, n in times[1:]) / (times[-1][0] - times[0][0])


def ray_data(args: argparse.Namespace, lens: mixlens.Lens, data: Path, tmp: Path, n: int) -> None:
    import ray

    cores = os.cpu_count() or 1
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, configure_logging=False)
    torch.set_num_threads(cores)  # the local run uses every core, as the actors together do
    kw = {"batch_size": args.batch_size, "max_tokens": args.max_tokens, "shard_size": args.shard_size}
    rows = []
    load0 = os.getloadavg()

    def timed(name: str, **extra: object) -> None:
        out = tmp / name.replace(" ", "-")
        t0 = time.perf_counter()
        run_corpus(data, out, METHODS, overwrite=True, **kw, **extra)  # type: ignore[arg-type]
        wall = time.perf_counter() - t0
        rows.append((name, wall, n / wall, steady_rate(out)))

    try:
        for _ in range(args.repeats):
            timed(f"local, {torch.get_num_threads()} threads", lens=lens)
            timed("ray-data, 1 actor", backend="ray-data", workers=1, num_cpus=1)
            timed(f"ray-data, {cores} actors", backend="ray-data", workers=cores, num_cpus=1)
    finally:
        ray.shutdown()
    load1 = os.getloadavg()
    print(f"SST-2 dev x{args.copies}, {n} examples, bundled {lens.name}, shard {args.shard_size}, batch "
          f"{args.batch_size}, {cores} cores, local Ray; {args.repeats} run(s) each, interleaved")
    print(f"load average (1, 5, 15 min) before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; after: "
          f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    print(f"{'run':28s} {'wall s':>8s} {'ex/s (wall)':>12s} {'ex/s (steady)':>14s}")
    best: dict[str, tuple[float, float]] = {}
    for name, wall, rate, steady in rows:
        print(f"{name:28s} {wall:8.1f} {rate:12.1f} {steady:14.1f}")
        w, st = best.get(name, (0.0, 0.0))
        best[name] = (max(w, rate), max(st, steady))
    names = list(best)
    local, one, many = (best[k] for k in names)
    print(f"ratio ray-data ({cores} actors) / local: wall {many[0] / local[0]:.2f}, steady {many[1] / local[1]:.2f}"
          "  (target >= 0.90)")
    print(f"scaling 1 -> {cores} actors: wall {many[0] / one[0]:.2f}x, steady {many[1] / one[1]:.2f}x")
    per_actor = one[1]
    print(f"per-actor steady rate (1 actor): {per_actor:.1f} ex/s; 1,000,000 sentences with N such actors "
          "(linear scaling):")
    for k in (1, 2, 4, 8, 16, 32, 64):
        print(f"  N={k:3d}: {1e6 / (k * per_actor) / 3600:8.2f} h")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=872, help="examples of SST-2 dev to use")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--shard-size", type=int, default=None, help="default 256 (64 with --ray-data)")
    ap.add_argument("--ray-data", action="store_true", help="Ray Data backend vs local backend, 1 and N actors")
    ap.add_argument("--copies", type=int, default=1, help="--ray-data: the corpus repeated this many times")
    args = ap.parse_args()
    args.shard_size = args.shard_size or (64 if args.ray_data else 256)
    if not SST2.is_file():
        raise SystemExit(f"needs {SST2}")
    lens = mixlens.load()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "sst2.tsv"
        with SST2.open() as src:  # the first --limit rows, so both sides read the same examples
            lines = [line for k, line in enumerate(src) if k <= args.limit]
        data.write_text("".join(lines[:1] + lines[1:] * (args.copies if args.ray_data else 1)))
        if args.ray_data:
            ray_data(args, lens, data, Path(tmp), len(lines[1:]) * args.copies)
            return
        texts = [e.text for e in iter_examples(data)]
        forward_only(lens, texts[:64], args.batch_size, args.max_tokens, args.shard_size)  # warm-up
        fwd, eng, run = [], [], []
        for _ in range(args.repeats):
            fwd.append(forward_only(lens, texts, args.batch_size, args.max_tokens, args.shard_size))
            eng.append(engine_only(lens, texts, args.batch_size, args.max_tokens, args.shard_size))
            run.append(corpus(lens, data, Path(tmp) / "out", args.batch_size, args.max_tokens, args.shard_size))
    n = len(texts)
    f, e, c = statistics.median(fwd), statistics.median(eng), statistics.median(run)
    print(f"SST-2 dev, {n} examples, bundled {lens.name}, batch {args.batch_size}, {torch.get_num_threads()} "
          f"threads, median of {args.repeats}")
    print(f"forward only (tokenize + forward): {n / f:8.1f} examples/s")
    print(f"engine only (trace + norm family): {n / e:8.1f} examples/s")
    print(f"corpus run, norm family (summary): {n / c:8.1f} examples/s")
    print(f"ratio corpus / forward-only: {f / c:.2f}  (target >= 0.70)")
    print(f"ratio corpus / engine-only:  {e / c:.2f}  (the corpus machinery's own overhead)")


if __name__ == "__main__":
    main()
