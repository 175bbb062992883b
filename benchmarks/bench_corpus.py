"""Corpus throughput: examples/s of a whole `run_corpus` with the norm family (norm, norm_res, norm_resln,
plus mixing ratios, entropies, token-type masses, Parquet shards, manifest) over SST-2 dev on the bundled
model, against plain forward passes (tokenize + model forward, no hooks) over the same batches, in one run.

Runs are interleaved and the median of `--repeats` is reported; the target is ratio ≥ 0.70.

    python benchmarks/bench_corpus.py [--repeats 3] [--limit 872] [--batch-size 32]
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=872, help="examples of SST-2 dev to use")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--shard-size", type=int, default=256)
    args = ap.parse_args()
    if not SST2.is_file():
        raise SystemExit(f"needs {SST2}")
    lens = mixlens.load()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "sst2.tsv"
        with SST2.open() as src:  # the first --limit rows, so both sides read the same examples
            data.write_text("".join(line for k, line in enumerate(src) if k <= args.limit))
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
