"""benchmarks/bench_evaluate.py helpers: the CoNLL-U next-word prompts and the merge of consecutive runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from mixlens.explain.evaluate import Evaluation, Example

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_evaluate", ROOT / "benchmarks" / "bench_evaluate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_conllu_prefixes(tmp_path):
    f = tmp_path / "x.conllu"
    f.write_text(
        "# sent_id = 1\n# text = The cat sat on the warm mat.\n1\tThe\n\n"
        "# text = Too short here.\n\n"
        "# text = This one ends with a number like 42.\n\n"
        '# text = She said that it was "fine" in the end today!"\n'
    )
    assert _bench().conllu_prefixes(f) == ["The cat sat on the warm", 'She said that it was "fine" in the end']


def _ev(texts: list[str], seconds: float) -> Evaluation:
    ex = [Example(t, ["a"], [1], np.zeros(1, bool), {}, 1.0, {"random": np.zeros(1)}, np.zeros(1)) for t in texts]
    return Evaluation("m", "v", "delete", ["random"], ex, 0, {"total": seconds}, [])


def test_consecutive_runs_are_cut_where_the_next_begins():
    bench = _bench()
    parts = bench.consecutive([_ev(["a", "b", "c", "d"], 8.0), _ev(["c", "d", "e"], 3.0)])
    merged = bench.merge(parts)
    assert [e.text for e in merged.examples] == ["a", "b", "c", "d", "e"]
    assert merged.timings["total"] == 4.0 + 3.0  # the first run's time scaled by the share kept (2 of 4)
