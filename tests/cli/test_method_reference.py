"""docs/reference/methods.md is what scripts/method_reference.py writes from the registry and `mixlens.cards`, and
every registered method has a complete card whose named tests exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from mixlens import catalog
from mixlens.cards import CARDS, NONE, Card

ROOT = Path(__file__).resolve().parents[2]
TEST_REF = re.compile(r"(?:(?P<path>(?:tests|benchmarks)/[\w/]+\.py))?(?:::(?P<name>\w+))?")


def _generator():
    spec = importlib.util.spec_from_file_location("method_reference", ROOT / "scripts" / "method_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_in_sync_with_the_registry_and_the_cards():
    page = ROOT / "docs" / "reference" / "methods.md"
    assert page.read_text(encoding="utf-8") == _generator().render(), (
        "docs/reference/methods.md is out of date: run python scripts/method_reference.py"
    )


def test_every_shipped_method_has_a_card_and_every_card_a_method():
    shipped = [m.name for m in _generator().shipped()]
    assert set(CARDS) == set(shipped)
    assert len(shipped) == len(catalog.load())  # the shipped catalog lists the same methods


def problems(card: Card) -> list[str]:
    """What a card lacks: an empty template field, a tolerance or test without an official comparison, an official
    comparison without its tolerance and test, or a named test that the repository does not define."""
    out = [f"empty {f}" for f in ("definition", "passes", "memory", "official") if not getattr(card, f).strip()]
    if card.official == NONE:
        out += ["a tolerance or test without an official comparison"] if card.tolerance or card.check else []
        return out
    if not (card.tolerance.strip() and card.check.strip()):
        return [*out, "an official comparison without its tolerance and test"]
    refs = [m for m in TEST_REF.finditer(card.check) if m["path"] or m["name"]]
    if not refs:
        out.append("the check names no test or benchmark")
    path = None
    for m in refs:  # `::name` alone: a test of the file named before it
        path = m["path"] or path
        file = ROOT / path if path else None
        if file is None or not file.is_file():
            out.append(f"no file {path} for {m['name']}")
        elif m["name"] and not re.search(rf"^def {m['name']}\(", file.read_text(encoding="utf-8"), re.M):
            out.append(f"{path} defines no {m['name']}")
    return out


@pytest.mark.parametrize("name", [m["name"] for m in catalog.load()])
def test_every_card_fills_the_template_and_its_tests_exist(name):
    assert problems(CARDS[name]) == [], name


def test_an_incomplete_card_is_caught():
    assert problems(Card("d", "p", "m", official="some tool", tolerance="1e-6")) == [
        "an official comparison without its tolerance and test"
    ]
    assert problems(Card("", "p", "m")) == ["empty definition"]
    assert problems(Card("d", "p", "m", tolerance="1e-6")) == ["a tolerance or test without an official comparison"]
    gone = Card(
        "d", "p", "m", "tool", "1e-6", "tests/methods/test_attnlrp.py::test_equals_nothing and ::test_equals_lxt"
    )
    assert problems(gone) == ["tests/methods/test_attnlrp.py defines no test_equals_nothing"]
    assert problems(Card("d", "p", "m", "tool", "1e-6", "tests/methods/no_such_file.py::test_x")) == [
        "no file tests/methods/no_such_file.py for test_x"
    ]


def test_the_generator_refuses_a_method_without_a_card(monkeypatch):
    gen = _generator()
    monkeypatch.setattr(gen, "CARDS", {k: v for k, v in CARDS.items() if k != "alti"})
    with pytest.raises(SystemExit, match="no card .* alti"):
        gen.render()
