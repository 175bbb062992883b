"""CLI start-up: fresh-process time of `mixlens --help` and of every `mixlens CMD --help`.

Each command runs `--runs` times in a new interpreter (`python -m mixlens ...`); the table gives the median wall
time and the median CPU time (user + system of the child, less sensitive to other load on the machine), next to
a bare `python -c pass` for reference. Run from the repository root:

    PYTHONPATH=src python benchmarks/bench_startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one fresh process; fails loudly on a non-zero exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per command (median reported)")
    args = ap.parse_args()

    import typer

    from mixlens.cli import app

    names = [c for c in typer.main.get_command(app).commands]  # type: ignore[attr-defined]
    cases = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("mixlens --help", [sys.executable, "-m", "mixlens", "--help"]),
    ]
    cases += [(f"mixlens {n} --help", [sys.executable, "-m", "mixlens", n, "--help"]) for n in names]
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"median of {args.runs} fresh processes"
    )
    print(f"{'command':36s} {'wall s':>7s} {'CPU s':>7s}")
    worst = 0.0
    for label, argv in cases:
        runs = [timed(argv) for _ in range(args.runs)]
        wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        if label.startswith("mixlens"):
            worst = max(worst, wall)
        print(f"{label:36s} {wall:7.3f} {cpu:7.3f}")
    print(f"slowest mixlens --help: {worst:.3f} s wall")


if __name__ == "__main__":
    main()
