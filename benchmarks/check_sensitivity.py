"""How small a broken piece the per-run reconstruction check catches in row mode (docs/guides/your-model.md).

    python benchmarks/check_sensitivity.py [--family llama qwen2 gpt2] [--dtype float32 bfloat16]
        [--tokens 256 1024 2048] [--piece W_O ...]   (--dtype float16 too)

For each random causal LM (`tests/engine/test_row_check.row_model`: the llama layout, qwen2's with value biases, the
gpt2 layout), dtype and input length, `analyze(rows="last")` with the norm family runs once clean (its largest error
as a share of the tolerance) and then with one piece of layer 1 read off the model's by a relative amount
(`test_row_check.broken`: W_O, W_V, a value bias, the norm's γ, the residual x, b_O where the layout has one). The
smallest amount on the grid that the check refuses is found by bisection (a larger one is refused too), and printed
as one table row per (family, dtype, tokens). Run it with another checkout's `src` on PYTHONPATH to measure that
checkout's check (the test helpers only use the public API).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import transformers as T

import mixlens
from mixlens.errors import ReconstructionError
from mixlens.loading import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the tests' helpers
from tests.engine.test_row_check import PIECES, broken, long_text, row_model  # noqa: E402

GRID = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""The relative errors tried."""


def refused(lens: mixlens.Lens, text: str, n: int, piece: str, by: float) -> bool:
    with broken(lens, piece, by):
        try:
            lens.analyze([text], ["norm", "norm_res", "norm_resln"], max_length=n, rows="last")
        except ReconstructionError:
            return True
    return False


def smallest(lens: mixlens.Lens, text: str, n: int, piece: str) -> str:
    """The smallest grid value refused (bisection; '>1' when even 100 % passes)."""
    lo, hi = -1, len(GRID) - 1  # GRID[hi] is refused once checked; GRID[lo] passes
    if not refused(lens, text, n, piece, GRID[hi]):
        return ">1"
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if refused(lens, text, n, piece, GRID[mid]):
            hi = mid
        else:
            lo = mid
    return f"{GRID[hi]:g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", nargs="+", default=["llama", "qwen2", "gpt2"])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[256, 1024, 2048])
    ap.add_argument("--piece", nargs="+", default=list(PIECES))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    tokenizer = T.AutoTokenizer.from_pretrained(default_model_path())
    tokenizer.model_max_length = max(args.tokens) + 8
    print(f"| family | dtype | tokens | clean (share of tolerance) | {' | '.join(args.piece)} |")
    print("|---" * (4 + len(args.piece)) + "|")
    for family in args.family:
        for dtype in args.dtype:
            lens = mixlens.Lens(row_model(family, tokenizer), tokenizer, dtype=dtype)
            for n in args.tokens:
                text = long_text(n)
                res = lens.analyze([text], ["norm", "norm_res", "norm_resln"], max_length=n, rows="last")
                share = "—" if res.error_share is None else f"{float(res.error_share.max()):.2g}"
                cells = [
                    "—" if p == "b_O" and lens.adapter.layers[1].raw_b_o is None else smallest(lens, text, n, p)
                    for p in args.piece
                ]
                print(f"| {family} | {dtype} | {n} | {share} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
