"""Corpus throughput: examples/s of a whole `run_corpus` with the norm family (norm, norm_res, norm_resln,
plus mixing ratios, entropies, token-type masses, Parquet shards, manifest) over SST-2 dev on the bundled
model, against plain forward passes (tokenize + model forward, no hooks) over the same batches, in one run.

Runs are interleaved and the median of `--repeats` is reported; the target is ratio ≥ 0.70.

`--ray-data` instead times the Ray Data backend against the local backend on the same corpus (Ray's own overhead;
target >= 0.90) at the same number of torch threads: local with 1 thread against 1 actor, local with one thread per
core against one actor per core (1 thread each), on a local Ray, in A B A B order (the order reversed every other
repeat) so that the machine's load falls on both arms alike. Each run is reported whole (wall clock, model loading
included on both sides: the local run loads it inside the timed call as a user's run does, each actor in its
process), in steady state (examples per second between the first and the last shard file written)
and in CPU seconds (this process for the local backend; this process and every Ray process for Ray Data), with the
1-minute load average before and after it; the ratios are given as the median and range over the repeats. The
per-actor steady rate gives what N actors would take on a one-million-sentence corpus.

    python benchmarks/bench_corpus.py [--repeats 3] [--limit 872] [--batch-size 32]
    python benchmarks/bench_corpus.py --ray-data [--repeats 3] [--limit 872] [--shard-size 64] [--copies 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import mixlens
from mixlens.corpus import iter_examples
from mixlens.corpus.runner import run_corpus
from mixlens.pipeline import run_methods

SST2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2" / "dev.tsv"
METHODS = ["norm", "norm_res", "norm_resln"]


def planned_batches(
    lens: mixlens.Lens,
    texts: list[str],
    batch_size: int,
    max_tokens: int,
    shard_size: int,
    methods: list[str] | None = None,
):
    """The corpus runner's own batches (same shards, same sort), each tokenized once; traced for `methods`."""
    for s in range(0, len(texts), shard_size):
        yield from lens.batches(
            texts[s : s + shard_size], batch_size, order="length", max_tokens=max_tokens, trace=methods or False
        )


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
    run_corpus(
        data,
        out,
        METHODS,
        lens=lens,
        batch_size=batch_size,
        max_tokens=max_tokens,
        shard_size=shard_size,
        overwrite=True,
    )
    return time.perf_counter() - t0


def steady_window(out: Path) -> tuple[float, float, int]:
    """(time of the first shard file written, of the last, examples in the shards after the first): the run's
    steady state."""
    shards = json.loads((out / "manifest.json").read_text())["shards"]
    times = sorted(((out / s["file"]).stat().st_mtime, s["examples"]) for s in shards)
    return times[0][0], times[-1][0], sum(n for _, n in times[1:])


def steady_rate(out: Path) -> float:
    """Examples per second between the first and the last shard file written (the run's steady state)."""
    t0, t1, n = steady_window(out)
    return n / (t1 - t0) if t1 > t0 else float("nan")


class TreeCPU:
    """CPU seconds (user + system) of this process, and with `tree` of every process it started (Ray's GCS, raylet
    and workers: the actors and the tokenising tasks), sampled every 0.25 s so that a process that ends during a run
    counts up to its last sample; the samples give the CPU seconds between two moments (the steady state)."""

    def __init__(self, tree: bool) -> None:
        import threading

        import psutil  # Ray's own dependency

        self.me, self.tree = psutil.Process(), tree
        self.seen: dict[tuple[int, float], float] = {}
        self.series: list[tuple[float, float]] = []  # (time.time(), CPU seconds so far)
        self.stop = threading.Event()
        self.sample()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        import psutil

        for p in [self.me, *(self.me.children(recursive=True) if self.tree else [])]:
            try:
                t = p.cpu_times()
                self.seen[(p.pid, p.create_time())] = t.user + t.system
            except psutil.Error:  # ended meanwhile: its last sample stays
                pass
        self.series.append((time.time(), sum(self.seen.values())))

    def loop(self) -> None:
        while not self.stop.wait(0.25):
            self.sample()

    def seconds(self) -> float:
        """CPU seconds from the start to now; ends the sampling."""
        self.stop.set()
        self.thread.join()
        self.sample()
        return self.series[-1][1] - self.series[0][1]

    def between(self, t0: float, t1: float) -> float:
        """CPU seconds between two moments (time.time()), interpolated between the samples."""
        ts, cs = zip(*self.series, strict=True)
        return float(np.interp(t1, ts, cs) - np.interp(t0, ts, cs))


def spread(xs: list[float]) -> str:
    """'median (min–max)' of one ratio over the repeats."""
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else f"{xs[0]:.2f}"


def ray_data(args: argparse.Namespace, lens: mixlens.Lens, data: Path, tmp: Path, n: int) -> None:
    """Local backend against Ray Data at the same number of torch threads: local with 1 thread against 1 actor, local
    with one thread per core against one actor per core (1 thread each). The four runs of a repeat follow each other
    within minutes (A B A B), the order reversed every other repeat, so that a change in the machine's load falls on
    both arms alike."""
    import ray

    cores = os.cpu_count() or 1
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, configure_logging=False)
    kw = {"batch_size": args.batch_size, "max_tokens": args.max_tokens, "shard_size": args.shard_size}
    arms = {  # name: (torch threads of the local run, or None; Ray Data actors)
        "local, 1 thread": (1, 0),
        "ray-data, 1 actor": (None, 1),
        f"local, {cores} threads": (cores, 0),
        f"ray-data, {cores} actors": (None, cores),
    }
    rows: list[dict] = []

    def timed(name: str, rep: int) -> None:
        threads, actors = arms[name]
        out = tmp / name.replace(" ", "-").replace(",", "")
        load = os.getloadavg()[0]
        if threads:
            torch.set_num_threads(threads)
        cpu = TreeCPU(tree=not threads)  # the local backend computes in this process; Ray Data in Ray's
        # both arms load the model inside the timed call, as a user's run does (the Ray actors in their processes)
        extra = {} if threads else {"backend": "ray-data", "workers": actors, "num_cpus": 1}
        t0 = time.perf_counter()
        run_corpus(data, out, METHODS, overwrite=True, **kw, **extra)  # type: ignore[arg-type]
        wall = time.perf_counter() - t0
        total = cpu.seconds()
        s0, s1, steady_n = steady_window(out)
        cpu_steady = steady_n / cpu.between(s0, s1) if s1 > s0 else float("nan")
        rows.append({"name": name, "rep": rep, "wall": wall, "rate": n / wall, "steady": steady_rate(out),
                     "cpu": total, "cpu_rate": n / total, "cpu_steady": cpu_steady, "load": load,
                     "load_after": os.getloadavg()[0]})  # fmt: skip

    try:
        order = list(arms)
        for rep in range(args.repeats):
            for name in order if rep % 2 == 0 else order[::-1]:
                timed(name, rep)
    finally:
        ray.shutdown()
    print(f"SST-2 dev x{args.copies}, {n} examples, bundled {lens.name}, shard {args.shard_size}, batch "
          f"{args.batch_size}, {cores} cores, local Ray; {args.repeats} repeat(s), A B A B order")  # fmt: skip
    print("ex/s: per second of wall clock, whole run and steady state; ex/CPU s: per CPU second, the same two")
    print(f"{'run':22s} {'rep':>3s} {'load':>11s} {'wall s':>7s} {'ex/s':>7s} {'steady':>7s} {'CPU s':>7s} "
          f"{'ex/CPU s':>8s} {'steady':>7s}")  # fmt: skip
    for r in rows:
        print(f"{r['name']:22s} {r['rep']:3d} {r['load']:5.1f}-{r['load_after']:<5.1f} {r['wall']:7.1f} "
              f"{r['rate']:7.1f} {r['steady']:7.1f} {r['cpu']:7.1f} {r['cpu_rate']:8.1f} "
              f"{r['cpu_steady']:7.1f}")  # fmt: skip
    by = {(r["name"], r["rep"]): r for r in rows}
    names = list(arms)
    print("Ray Data / local at the same torch threads, median (min-max) over the repeats:")
    for local, ray_arm in ((names[0], names[1]), (names[2], names[3])):
        pairs = [(by[(local, k)], by[(ray_arm, k)]) for k in range(args.repeats)]
        wall = [b["rate"] / a["rate"] for a, b in pairs]
        steady = [b["steady"] / a["steady"] for a, b in pairs]
        cpu = [b["cpu_rate"] / a["cpu_rate"] for a, b in pairs]
        cpu_steady = [b["cpu_steady"] / a["cpu_steady"] for a, b in pairs]
        print(f"  {ray_arm} / {local} (target >= 0.90): wall {spread(wall)}, steady {spread(steady)}; per CPU "
              f"second {spread(cpu)}, steady {spread(cpu_steady)}")  # fmt: skip
    for key, label in (("rate", "wall"), ("steady", "steady")):
        scale = [by[(names[3], k)][key] / by[(names[1], k)][key] for k in range(args.repeats)]
        print(f"scaling 1 -> {cores} actors, {label}: {spread(scale)}x")
    per_actor = statistics.median(by[(names[1], k)]["steady"] for k in range(args.repeats))
    print(f"per-actor steady rate (1 actor, median): {per_actor:.1f} ex/s; 1,000,000 sentences with N such actors "
          "(linear scaling):")  # fmt: skip
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
    print(
        f"SST-2 dev, {n} examples, bundled {lens.name}, batch {args.batch_size}, {torch.get_num_threads()} "
        f"threads, median of {args.repeats}"
    )
    print(f"forward only (tokenize + forward): {n / f:8.1f} examples/s")
    print(f"engine only (trace + norm family): {n / e:8.1f} examples/s")
    print(f"corpus run, norm family (summary): {n / c:8.1f} examples/s")
    print(f"ratio corpus / forward-only: {f / c:.2f}  (target >= 0.70)")
    print(f"ratio corpus / engine-only:  {e / c:.2f}  (the corpus machinery's own overhead)")


if __name__ == "__main__":
    main()
