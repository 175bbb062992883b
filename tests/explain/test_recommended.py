"""explain on a decoder runs the recommended methods by default and says which others exist; methods that take no
target say that they explain the predicted position, not a requested target or foil (issue 45, item 4)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mixlens.explain.attributions import default_methods
from mixlens.methods import get, registry
from tests.conftest import random_lens, run_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lm(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("lm") / "lm"
    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM")
    lens.model.save_pretrained(folder)
    lens.tokenizer.save_pretrained(folder)
    return folder


def test_recommended_methods_are_the_docs_recommendation():
    """The registry's declaration is what docs/findings/evaluate.md's decoder findings recommend, and README says it."""
    picked = registry.explainers("causal", recommended=True)
    assert picked and all(get(m).explains for m in picked)
    docs = (ROOT / "docs" / "findings" / "evaluate.md").read_text(encoding="utf-8")
    advice = re.search(r"\*\*Reach for (.*?)\*\*", docs)
    assert advice is not None and set(re.findall(r"`(\w+)`", advice[1])) == set(picked)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/findings/evaluate.md" in readme and "--task blimp" in readme
    assert all(f"`{m}`" in readme for m in picked)
    assert registry.explainers("classifier", recommended=True) == []  # classifiers keep every method


def test_explain_runs_the_recommended_methods_by_default(lm, tmp_path, capsys):
    out = tmp_path / "e.json"
    argv = ["explain", "The keys to the cabinet", "--model", str(lm), "-f", "json", "-o", str(out)]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    picked = registry.explainers("causal", defaults=True, recommended=True)
    assert list(json.loads(out.read_text())["inputs"][0]["scores"]) == picked
    others = [m for m in default_methods("causal") if m not in picked]
    assert f"explaining with {', '.join(picked)}" in err and "--method all" in err
    assert all(m in err for m in others)


def test_method_all_runs_every_applicable_method(lm, tmp_path, capsys):
    out = tmp_path / "e.json"
    argv = ["explain", "The keys to", "--model", str(lm), "--method", "all", "-f", "json", "-o", str(out)]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    from mixlens.adapters import family_for

    family = family_for("llama")
    assert list(json.loads(out.read_text())["inputs"][0]["scores"]) == default_methods("causal", family)
    code, _, err = run_cli([*argv, "--method", "attention"], capsys)
    assert code == 2 and "give it alone" in err


def test_methods_without_a_target_say_what_they_explain(lm, tmp_path, capsys):
    """flow_routes_tokens and the maps take no target: under a target/foil header they say so."""
    base = ["explain", "The keys to the cabinet", "--model", str(lm), "--method", "flow_routes_tokens"]
    code, out, err = run_cli([*base, "--method", "logit_attn", "--target", "cat", "--foil", "dog"], capsys)
    assert code == 0, err
    assert "flow_routes_tokens: take no target; it explains the predicted position" in " ".join(out.split())
    assert "logit_attn:" not in out
    code, out, err = run_cli([*base, "--format", "html", "-o", str(tmp_path / "e.html")], capsys)
    assert code == 0 and "take no target" not in (tmp_path / "e.html").read_text()  # no target requested: no note
    code, out, err = run_cli([*base, "--foil", "dog", "--format", "html", "-o", str(tmp_path / "f.html")], capsys)
    assert code == 0 and "flow_routes_tokens: take no target" in (tmp_path / "f.html").read_text()
