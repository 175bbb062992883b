"""Memory benchmark: peak RSS of a fresh process running `lens.analyze` (default methods) on 10,000 short inputs
plus one 512-token input. Results are stored per batch, so memory follows the work, not the longest input
(target < 2 GB; before per-batch storage every array was padded to 512 tokens for all 10,001 inputs).

    python benchmarks/bench_memory.py [--short 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from rss import HERE

CODE = """
import sys, time, mixlens
sys.path.insert(0, {here!r})
from rss import peak_gib
from transformers.utils import logging
logging.set_verbosity_error()
logging.disable_progress_bar()
lens = mixlens.load()
base = peak_gib()
words = "the quick brown fox jumps over the lazy dog".split()
short = [" ".join(words[(i + k) % 9] for k in range(3 + i % 8)) for i in range({n})]
long = " ".join(words[i % 9] for i in range(600))  # > 512 tokens: truncated to 512
t0 = time.perf_counter()
res = lens.analyze(short + [long])
dt = time.perf_counter() - t0
assert len(res.tokens[-1]) == 512 and res.reconstruction_error.max() <= 1e-4
print(base, peak_gib(), res.nbytes / 2**30, dt)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", type=int, default=10_000, help="number of short inputs")
    n = ap.parse_args().short
    code = CODE.format(here=HERE, n=n)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base, peak, held, dt = map(float, out.stdout.split())
    print(
        f"{n} short inputs + one 512-token input: peak RSS {peak:.2f} GiB (after loading the model {base:.2f}), "
        f"results held {held:.3f} GiB, analyze {dt:.1f} s; target < 2 GB: {'met' if peak * 2**30 < 2e9 else 'OVER'}; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        json.dumps(
            {
                "short": n,
                "peak_rss_gib": round(peak, 3),
                "model_loaded_rss_gib": round(base, 3),
                "results_gib": round(held, 4),
                "seconds": round(dt, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
