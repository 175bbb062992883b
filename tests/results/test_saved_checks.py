"""Saved analyses and explanations read with `--from` are checked before anything is drawn (#45 items 14, 20): the
layer count bounded and the same on every axis, each method's extras with the axes its registry entry declares,
the flow routes' position inside its input, probabilities in [0, 1]."""

from __future__ import annotations

import copy
import json

import pytest

from mixlens.explain import explain
from tests.conftest import random_lens, run_cli


@pytest.fixture(scope="module")
def saved(tokenizer):
    """(the JSON of an alti_logit explanation, the JSON of a flow_routes analysis) of a small random GPT-2."""
    lens = random_lens("gpt2", tokenizer, head="AutoModelForCausalLM")
    expl = json.loads(explain(lens, ["the cat sat"], ["alti_logit"]).dumps())
    routes = lens.analyze(["the cat sat"], ["flow_routes"]).to_json()
    return expl, json.loads(json.dumps(routes))


def one_line(argv: list[str], capsys, *words: str) -> None:
    code, _, err = run_cli(argv, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]


def test_the_untouched_files_draw(saved, tmp_path, capsys):
    expl, routes = saved
    (tmp_path / "e.json").write_text(json.dumps(expl))
    (tmp_path / "r.json").write_text(json.dumps(routes))
    argv = ["plot", "--view", "logit-layers", "--from", str(tmp_path / "e.json"), "-o", str(tmp_path / "e.png")]
    assert run_cli(argv, capsys)[0] == 0
    argv = ["plot", "--view", "routes", "--from", str(tmp_path / "r.json"), "-o", str(tmp_path / "r.png")]
    assert run_cli(argv, capsys)[0] == 0


@pytest.mark.parametrize("position", [99, -1, 1e300, 2.5, 5])
@pytest.mark.parametrize("command", ["plot", "report"])
def test_a_crafted_routes_position_is_refused(position, command, saved, tmp_path, capsys):
    """#45 item 20: IndexError / ZeroDivisionError / OverflowError tracebacks."""
    routes = copy.deepcopy(saved[1])
    routes["inputs"][0]["methods"]["flow_routes"]["extras"]["position"]["values"] = position
    (tmp_path / "r.json").write_text(json.dumps(routes))
    out = ["-o", str(tmp_path / ("r.png" if command == "plot" else "r.html"))]
    view = ["--view", "routes"] if command == "plot" else []
    one_line([command, *view, "--from", str(tmp_path / "r.json"), *out], capsys, "position")


def _layers(expl: dict, n_layers: int) -> dict:
    e = copy.deepcopy(expl)
    ex = e["inputs"][0]["methods"]["alti_logit"]["extras"]
    m = len(e["inputs"][0]["tokens"])
    ex["layers"]["values"] = [[0.01] * m] * n_layers
    ex["mlp"]["values"] = [0.0] * n_layers
    return e


def _mlp(expl: dict, n: int) -> dict:
    e = copy.deepcopy(expl)
    e["inputs"][0]["methods"]["alti_logit"]["extras"]["mlp"]["values"] = [0.0] * n
    return e


def _mlp_axes(expl: dict) -> dict:
    e = copy.deepcopy(expl)
    m = len(e["inputs"][0]["tokens"])
    e["inputs"][0]["methods"]["alti_logit"]["extras"]["mlp"] = {"dims": ["source"], "values": [0.0] * m}
    return e


def _probability(expl: dict, p: float) -> dict:
    e = copy.deepcopy(expl)
    e["inputs"][0]["target"]["probability"] = p
    return e


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda e: _layers(e, 5000), ["5000 layers", "at most"]),
        (lambda e: _mlp(e, 3), ["alti_logit.mlp' has 3", "2 layers"]),
        (_mlp_axes, ["alti_logit.mlp", "axes"]),
        (lambda e: _probability(e, 7), ["probability", "[0, 1]"]),
        (lambda e: _probability(e, -0.5), ["probability", "[0, 1]"]),
    ],
)
def test_a_crafted_explanation_is_refused_before_drawing(make, words, saved, tmp_path, capsys):
    """#45 item 14: a 136 KB file with 5,000 layers was drawn at that size (killed at 24 GB); an `mlp` extra of the
    wrong length and a probability of 7 were accepted."""
    (tmp_path / "e.json").write_text(json.dumps(make(saved[0])))
    out = str(tmp_path / "e.png")
    one_line(["plot", "--view", "logit-layers", "--from", str(tmp_path / "e.json"), "-o", out], capsys, *words)
    one_line(["report", "--from", str(tmp_path / "e.json"), "-o", str(tmp_path / "e.html")], capsys, *words)
