"""Wall time of the head/layer disabling sweep end to end through the CLI (`mixlens sweep`), bundled model, STS-B dev.

    python benchmarks/bench_sweep.py                 # all 1,500 pairs, mode uniform, batch size 64
    python benchmarks/bench_sweep.py --limit 200     # a subset

Prints the wall time and the machine's load average before and after (other jobs share the cores).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb" / "dev.tsv"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--out", default="/tmp/mixlens-bench-sweep")
    ap.add_argument("--data", default=str(DATA))
    a = ap.parse_args()
    from mixlens.cli import main as cli

    args = ["sweep", "-d", a.data, "--batch-size", str(a.batch_size), "-o", a.out]
    if a.limit:
        args += ["--limit", str(a.limit)]
    load0 = os.getloadavg()
    t = time.perf_counter()
    try:
        cli(args)
    except SystemExit as e:
        if e.code:
            raise
    wall = time.perf_counter() - t
    print(f"sweep {a.limit or 'all'} pairs: {wall:.0f} s wall; load average before {load0[0]:.1f}, "
          f"after {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
