"""docs/reference/methods.md is what scripts/method_reference.py writes from the registry, every registered method
declares a complete card in its registration (the registry refuses one without), and the tests a card names exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from mixlens import catalog
from mixlens.methods import REGISTRY, register
from mixlens.methods.registry import NONE, Card

ROOT = Path(__file__).resolve().parents[2]
TEST_REF = re.compile(r"(?:(?P<path>(?:tests|benchmarks)/[\w/]+\.py))?(?:::(?P<name>\w+))?")


def generator():
    """scripts/method_reference.py, loaded as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("method_reference", ROOT / "scripts" / "method_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_in_sync_with_the_registry():
    page = ROOT / "docs" / "reference" / "methods.md"
    assert page.read_text(encoding="utf-8") == generator().render(), (
        "docs/reference/methods.md is out of date: run python scripts/method_reference.py"
    )


def test_the_page_has_every_shipped_method():
    shipped = [m.name for m in generator().shipped()]
    assert shipped == [m["name"] for m in catalog.load()]  # the shipped catalog lists the same methods


def problems(card: Card) -> list[str]:
    """What a card lacks (`Card.problems`: an empty field, a tolerance or test without an official comparison, an
    official comparison without its tolerance and test), or a named test that the repository does not define."""
    out = card.problems()
    if card.official == NONE or out:
        return out
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
    assert problems(REGISTRY[name].card) == [], name


BG = ("global.md", "whole-layer and global attribution")


def test_an_incomplete_card_is_caught():
    assert problems(Card("d", "p", "m", BG, official="some tool", tolerance="1e-6")) == [
        "an official comparison without its tolerance and test"
    ]
    assert problems(Card("", "p", "m", BG)) == ["empty definition"]
    assert problems(Card("d", "p", "m", ("global.md", " "))) == ["empty background (page, what it covers)"]
    assert problems(Card("d", "p", "m", BG, tolerance="1e-6")) == ["a tolerance or test without an official comparison"]
    gone = Card(
        "d", "p", "m", BG, "tool", "1e-6", "tests/methods/test_attnlrp.py::test_equals_nothing and ::test_equals_lxt"
    )
    assert problems(gone) == ["tests/methods/test_attnlrp.py defines no test_equals_nothing"]
    assert problems(Card("d", "p", "m", BG, "tool", "1e-6", "tests/methods/no_such_file.py::test_x")) == [
        "no file tests/methods/no_such_file.py for test_x"
    ]


def _plain(trace):
    return trace.mask


@pytest.mark.parametrize(
    "card, words",
    [
        (None, "method 'card_test' has no reference card: declare register(..., card=Card("),
        (Card("", "p", "m", BG), "method 'card_test': its reference card is incomplete: empty definition"),
        (Card("d", "p", "m", BG, tolerance="1e-6"), "incomplete: a tolerance or test without an official comparison"),
        (Card("d", "p", "no row mode", BG), "its memory says 'no row mode' but the method declares row_mode"),
    ],
)
def test_the_registry_refuses_a_method_without_a_complete_card(card, words):
    """A method is declared with its card in its one `register` call: without one (or with an incomplete one) the
    registration fails, at import, naming the method and what is missing."""
    with pytest.raises(RuntimeError, match=re.escape(words)):
        register("card_test", row_mode=True, card=card)(_plain)
    assert "card_test" not in REGISTRY


def test_a_method_registered_anywhere_is_on_the_page_it_is_given_to():
    """The page's card of a method comes from its registration alone: a method registered here (no other source
    file names it) gets a card rendered like the shipped ones, and the shipped page leaves it out."""
    gen = generator()
    card = Card("s_j = 1", "None.", "Nothing; output [n].", ("api.md", "the Python API"), note="a test method")
    try:
        register("card_test", dims=("source",), card=card)(_plain)
        page = gen.render([*gen.shipped(), REGISTRY["card_test"]])
        assert "| [`card_test`](#card_test) | [batch, source] | — |" in page
        assert "## `card_test`\n\n**Definition.** s_j = 1\n" in page
        assert "**Official implementation.** none compared — a test method.\n\nBackground: [api.md](api.md)" in page
        assert "card_test" not in gen.render()
    finally:
        REGISTRY.pop("card_test", None)
