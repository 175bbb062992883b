"""Gradient × input of a whole answer equals inseq's `input_x_gradient` on SmolLM2-135M-Instruct.

inseq (its own requirements) runs in its own interpreter: MIXLENS_INSEQ_PYTHON=/path/to/python (a virtual
environment with inseq and torch); skipped otherwise, and when the checkpoint is absent. The same definition on both
sides: the logit of each answer token under teacher forcing (inseq `attributed_fn="logit"`, the answer forced with
`generated_texts`; mixlens' target logit at the position before it), gradient × word embedding, reduced over the
hidden dims by the signed sum (mixlens `reduction="sum"`, inseq's `sum` aggregator) or the L2 norm (`l2`, inseq's
`vnorm`), inseq's normalisation off. inseq leaves the tokens after each step's prefix NaN; there mixlens' scores are
exactly 0 (causal attention). The inseq call is the one benchmarks/bench_answers_vs_inseq.py times.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

import mixlens

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    path = ROOT / "benchmarks" / "bench_answers_vs_inseq.py"
    spec = importlib.util.spec_from_file_location("bench_answers_vs_inseq", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inseq_python() -> str:
    exe = os.environ.get("MIXLENS_INSEQ_PYTHON")
    if not exe:
        pytest.skip("set MIXLENS_INSEQ_PYTHON to a Python with inseq to compare with inseq")
    return exe


def _smollm2() -> Path:
    root = Path(os.environ.get("MIXLENS_MODELS", Path.home() / ".cache" / "mixlens" / "models")).expanduser()
    path = root / "smollm2-135m-instruct"
    if not (path / "config.json").is_file():
        pytest.skip("smollm2-135m-instruct not fetched (python scripts/fetch_models.py smollm2-135m-instruct)")
    return path


@pytest.fixture(scope="module")
def lens():
    return mixlens.load(_smollm2(), dtype="float32")


def _cases(bench, lens):
    yield "The capital of France is", " Paris, and the capital of Italy is Rome."
    yield bench.prompt_and_answer(lens, 48, 6)[:2]  # the benchmark's text, shorter


@pytest.mark.parametrize("case", [0, 1])
def test_single_token_gradient_x_input_equals_inseq(lens, case):
    """The logit of each answer token: mixlens' single-token gradient × input (`target` = the token, `position` = the
    one before it, on the text prompt + answer) per answer token, both reductions, against inseq step by step."""
    exe = _inseq_python()
    bench = _bench()
    prompt, answer = list(_cases(bench, lens))[case]
    p_ids = lens.encode([prompt]).inputs["input_ids"][0].tolist()
    ids = lens.encode([prompt + answer]).inputs["input_ids"][0].tolist()
    a_ids = ids[len(p_ids) :]
    assert ids[: len(p_ids)] == p_ids and len(a_ids) >= 6
    theirs = bench.inseq_attributions(exe, str(_smollm2()), prompt, answer, len(a_ids), fn="logit")
    assert theirs["ids"] == ids  # the same tokens
    n = len(ids)
    for reduction in ("sum", "l2"):
        ours = np.zeros((len(a_ids), n))
        for k, tid in enumerate(a_ids):  # the logit of answer token k, read at the position before it
            opts = {"target": int(tid), "position": len(p_ids) + k - 1, "reduction": reduction}
            ours[k] = lens.analyze(prompt + answer, ["grad_x_input"], options={"grad_x_input": opts})[
                "grad_x_input"
            ].values[0, :n]
        mat = theirs[reduction]
        assert mat.shape == (len(a_ids), n)
        for k in range(len(a_ids)):  # inseq: step k attributes its prefix (prompt + answer[:k]) and nothing after
            assert not np.isnan(mat[k, : len(p_ids) + k]).any() and np.isnan(mat[k, len(p_ids) + k :]).all()
            assert (ours[k, len(p_ids) + k :] == 0).all()
        ok, diff, scale = bench.same(ours, mat)
        assert ok, (reduction, diff, scale)
        assert np.abs(mat[~np.isnan(mat)]).max() > 0.1  # not trivially equal


@pytest.mark.parametrize("case", [0, 1])
def test_answer_gradient_x_input_equals_inseq(lens, case):
    """The whole answer at once: `explain(lens, prompt, ["grad_x_input"], answer=...)` (each answer token's
    log-probability, the signed sum) equals inseq's input_x_gradient of log p (`attributed_fn="probability"`,
    `logprob=True`) — the comparison benchmarks/bench_answers_vs_inseq.py times."""
    exe = _inseq_python()
    bench = _bench()
    prompt, answer = list(_cases(bench, lens))[case]
    ids = lens.encode([prompt + answer]).inputs["input_ids"][0].tolist()
    n_answer = len(ids) - len(lens.encode([prompt]).inputs["input_ids"][0])
    theirs = bench.inseq_attributions(exe, str(_smollm2()), prompt, answer, n_answer, fn="logprob")
    ours = bench.answer_matrix(lens, "grad_x_input", prompt, answer)
    assert theirs["ids"] == ids
    assert theirs["sum"].shape == ours.shape == (n_answer, len(theirs["ids"]))
    ok, diff, scale = bench.same(ours, theirs["sum"])
    assert ok, (diff, scale)
    start = len(theirs["ids"]) - n_answer
    assert all((ours[k, start + k :] == 0).all() for k in range(n_answer))  # nothing from the tokens after
    assert np.abs(ours).max() > 0.1
