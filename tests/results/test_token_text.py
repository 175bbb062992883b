"""One token-display function (`mixlens.viz.labels.token_text`) for every view: byte-level BPE and SentencePiece
pieces are shown as text in reports, figures and the terminal (issue 45, item 1)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mixlens.result import Analysis, Attribution
from mixlens.viz import html as vh
from mixlens.viz import static
from mixlens.viz.labels import token_text
from mixlens.viz.terminal.analysis import print_results

CORPUS = ["The keys to the cabinet are on the table.\n", "Café — naïve résumé\tß 東京 🙂", "it is\n\nhere"] * 20


@pytest.fixture(scope="module")
def byte_level():
    """A byte-level BPE tokenizer (GPT-2's scheme) trained here on a few sentences."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def shown(text: str) -> str:
    return text.replace("\n", "⏎").replace("\t", "⇥") or "∅"


def test_byte_level_pieces_read_as_their_decoded_text(byte_level):
    """Every vocabulary entry that decodes to whole characters reads as the tokenizer's own decode."""
    checked = 0
    for piece, i in byte_level.get_vocab().items():
        text = byte_level.decode([i])
        if "\ufffd" in text:  # a piece of a multi-byte character
            continue
        assert token_text(piece) == shown(text), piece
        checked += 1
    assert checked > 100
    assert token_text("Ġkeys") == " keys" and token_text("Ċ") == "⏎" and token_text("ĠĠ") == "  "


def test_other_schemes_keep_their_text():
    assert token_text("▁keys") == " keys" and token_text("<0x0A>") == "⏎"  # SentencePiece
    for t in ["##ing", "[CLS]", "café", "ł", "<|endoftext|>", " Paris", "a", "!"]:  # WordPiece, decoded text
        assert token_text(t) == t
    assert token_text("") == "∅"


def _analysis() -> Analysis:
    toks = [["Ġkeys", "Ġare", "Ċ", "▁on"]]
    maps = Attribution(np.eye(4)[None, None], ("layer", "target", "source"), toks, "attention")
    scores = Attribution(np.array([[0.1, -0.4, 0.2, 0.3]]), ("source",), toks, "saliency")
    return Analysis("m", "0", ["keys are\n on"], toks, {"attention": maps, "saliency": scores}, {}, np.zeros(1))


def test_report_shows_tokens_as_text():
    """Heatmap axes and links read the payload's tokens; highlighted text and target rows are built from them."""
    res = _analysis()
    p = vh.build_payload(res)
    assert p["inputs"][0]["tokens"] == [" keys", " are", "⏎", " on"]
    doc = vh.render_report(res)
    assert "Ġ" not in doc and "Ċ" not in doc and "▁" not in doc
    assert json.loads(json.dumps(p))["inputs"][0]["tokens"][0] == " keys"


def test_analyze_terminal_shows_tokens_as_text(capsys):
    print_results(_analysis(), ["attention", "saliency"])
    out = capsys.readouterr().out
    assert "keys" in out and "⏎" in out
    assert "Ġ" not in out and "Ċ" not in out and "▁" not in out


def test_figures_show_tokens_as_text():
    res = _analysis()
    for fig in (static.heatmap_figure(res["attention"], [0]), static.token_scores_figure(res["saliency"], [0])):
        texts = [t.get_text() for ax in fig.axes for t in [*ax.get_xticklabels(), *ax.get_yticklabels(), *ax.texts]]
        assert any("keys" in t for t in texts)
        assert not any(c in t for t in texts for c in "ĠĊ▁")
