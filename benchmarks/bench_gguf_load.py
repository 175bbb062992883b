"""Peak resident memory of loading a GGUF checkpoint with `mixlens.load`, against the size of its weights in the
dtype asked for (issue 42: ≤ 1.3× the bfloat16 weights), and optionally transformers' own GGUF loading beside it.

    python benchmarks/bench_gguf_load.py DIR FILE [--dtype bfloat16] [--transformers]

Each loader runs in a fresh process (VmHWM of that process; the imports are measured separately)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from rss import HERE, peak_gib

CHILD = """
import sys, time, json, torch
sys.path.insert(0, {here!r})
from rss import peak_gib
import transformers
from mixlens.loading import pretrained
before = peak_gib()
t = time.perf_counter()
if {hf!r}:
    net = transformers.AutoModelForCausalLM.from_pretrained({d!r}, gguf_file={f!r}, dtype=getattr(torch, {dt!r}))
else:
    net = pretrained({d!r}, gguf_file={f!r}, dtype={dt!r})[0]
secs = time.perf_counter() - t
w = sum(p.numel() * p.element_size() for p in {{id(p): p for p in net.parameters()}}.values()) / 2**30
print(json.dumps(dict(loader="transformers" if {hf!r} else "mixlens", seconds=round(secs, 1), weights_gib=round(w, 3),
      imports_gib=round(before, 3), peak_gib=round(peak_gib(), 3), ratio=round(peak_gib() / w, 2),
      ratio_over_imports=round((peak_gib() - before) / w, 2))))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("file")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--transformers", action="store_true", help="also time transformers' own GGUF loading")
    args = ap.parse_args()
    for hf in (False, True) if args.transformers else (False,):
        code = CHILD.format(here=HERE, hf=hf, d=args.dir, f=args.file, dt=args.dtype)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr.strip()[-2000:]
        print(line)
    print(json.dumps({"parent_peak_gib": round(peak_gib(), 3), "at": time.strftime("%Y-%m-%d %H:%M")}))


if __name__ == "__main__":
    main()
