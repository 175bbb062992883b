"""Segments (`mixlens.explain.segments`): token spans of chat messages, spans, markers and passages; segment scores
are exact sums of token scores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import transformers as T

from mixlens.errors import MixlensError
from mixlens.explain import segments as S

MODELS = Path.home() / ".cache" / "mixlens" / "models"
CHAT = [
    {"role": "user", "content": "What is the access code?"},
    {"role": "assistant", "content": "It is 4721."},
    {"role": "user", "content": "And the room?"},
]


def checkpoint_tokenizer(name: str):
    path = MODELS / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"checkpoint {name} not present")
    return T.AutoTokenizer.from_pretrained(path)


def test_chat_messages_cover_their_content_tokens_and_nothing_else():
    tok = checkpoint_tokenizer("smollm2-135m-instruct")
    seg = S.chat(tok, CHAT)
    assert seg.labels == ["1 user", "2 assistant", "3 user"]
    templ = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    ids = templ["input_ids"] if isinstance(templ, dict) or hasattr(templ, "keys") else templ  # BatchEncoding
    assert seg.input_ids == list(ids)
    for m, s in zip(CHAT, seg.segments, strict=True):
        assert tok.decode(seg.input_ids[s.start : s.end]) == m["content"]
        assert seg.text[s.char_start : s.char_end] == m["content"]
    # the template's tokens (default system prompt, role headers, <|im_end|>) belong to no message
    outside = tok.decode([seg.input_ids[i] for i in seg.outside])
    assert "<|im_start|>" in outside and "assistant" in outside and "SmolLM" in outside
    assert len(seg.outside) + sum(s.end - s.start for s in seg.segments) == len(seg.input_ids)


def test_chat_content_in_the_default_system_prompt_is_found_in_its_own_message():
    tok = checkpoint_tokenizer("smollm2-135m-instruct")
    seg = S.chat(tok, [{"role": "user", "content": "helpful"}])  # also a word of the default system prompt
    (s,) = seg.segments
    assert seg.text[s.char_start :].startswith("helpful<|im_end|>")


def test_chat_errors_are_one_line():
    tok = checkpoint_tokenizer("smollm2-135m-instruct")
    for bad in ({"role": "user", "content": "x"}, [], [{"role": "user"}], [{"role": "user", "content": 3}]):
        with pytest.raises(MixlensError, match="message|list"):
            S.check_messages(bad)
    with pytest.raises(MixlensError, match="no chat template"):
        S.chat(checkpoint_tokenizer("gemma-3-270m"), CHAT)
    qwen = checkpoint_tokenizer("qwen2.5-coder-0.5b-instruct")
    with pytest.raises(MixlensError, match="role 'narrator'"):
        S.chat(qwen, [{"role": "narrator", "content": "Once upon a time"}])
    assert S.chat(tok, CHAT).labels  # the good conversation passes


def test_chat_template_exceptions_become_mixlens_errors(tokenizer):
    tok = T.AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'user' %}{{ raise_exception('only users') }}"
        "{% endif %}[{{ m['content'] }}]{% endfor %}"
    )
    with pytest.raises(MixlensError, match=r"rejects message 2 \(role 'assistant'\): only users"):
        S.chat(tok, CHAT)
    seg = S.chat(tok, [{"role": "user", "content": "hello world"}, {"role": "user", "content": "again"}])
    assert [seg.text[s.char_start : s.char_end] for s in seg.segments] == ["hello world", "again"]
    with pytest.raises(MixlensError, match="no chat template"):
        S.chat(tokenizer, CHAT)  # the bundled tokenizer has none


def test_read_chat_from_file_and_string(tmp_path):
    f = tmp_path / "chat.json"
    f.write_text(json.dumps(CHAT))
    assert S.read_chat(f) == CHAT
    assert S.read_chat(json.dumps(CHAT)) == CHAT
    f.write_text('{"role": "user"}')
    with pytest.raises(MixlensError, match="list"):
        S.read_chat(f)
    f.write_text("[{")
    with pytest.raises(MixlensError, match="not valid JSON"):
        S.read_chat(f)
    with pytest.raises(MixlensError, match="does not exist"):
        S.read_chat(tmp_path / "missing.json")


TEXT = "Doc: the cat sat. Doc: a dog ran far away. Doc: birds sing loudly today."


def test_spans_map_character_ranges_to_their_tokens(tokenizer):
    seg = S.spans(tokenizer, TEXT, [(5, 17), ("dog part", 23, 42)])
    assert seg.labels == ["span 1", "dog part"]
    words = [tokenizer.decode(seg.input_ids[s.start : s.end]) for s in seg.segments]
    assert words == ["the cat sat.", "a dog ran far away."]
    assert seg.input_ids[0] == tokenizer.cls_token_id and 0 in seg.outside  # [CLS] is in no span
    for bad in ([(5, 500)], [(-1, 3)], [(4, 4)]):
        with pytest.raises(MixlensError, match="outside the text"):
            S.spans(tokenizer, TEXT, bad)
    with pytest.raises(MixlensError, match="overlap"):
        S.spans(tokenizer, TEXT, [(0, 10), (5, 20)])


def test_markers_start_segments(tokenizer):
    seg = S.markers(tokenizer, "intro. " + TEXT, ["Doc:"])
    assert seg.labels == ["Doc: #1", "Doc: #2", "Doc: #3"]
    texts = [tokenizer.decode(seg.input_ids[s.start : s.end]) for s in seg.segments]
    assert texts == ["doc : the cat sat.", "doc : a dog ran far away.", "doc : birds sing loudly today."]
    assert tokenizer.decode([seg.input_ids[i] for i in seg.outside]) == "[CLS] intro. [SEP]"
    with pytest.raises(MixlensError, match="'Chapter' does not occur"):
        S.markers(tokenizer, TEXT, ["Doc:", "Chapter"])


def test_passages_split_at_the_separator(tokenizer):
    seg = S.passages(tokenizer, "one two\n\nthree\n\n\n\nfour five six", "\n\n")
    assert seg.labels == ["passage 1", "passage 2", "passage 3"]
    assert [tokenizer.decode(seg.input_ids[s.start : s.end]) for s in seg.segments] == [
        "one two",
        "three",
        "four five six",
    ]
    with pytest.raises(MixlensError, match="does not occur"):
        S.passages(tokenizer, "no separator here", "||")


@pytest.mark.parametrize("seed", range(5))
def test_segment_scores_are_exact_sums_of_token_scores(tokenizer, seed):
    rng = np.random.default_rng(seed)
    words = [f"w{rng.integers(100)}" for _ in range(60)]
    text = " ".join(words)
    cuts = np.sort(rng.choice(np.arange(1, len(text)), size=8, replace=False))
    ranges = [(int(a), int(b)) for a, b in zip(cuts[::2], cuts[1::2], strict=True)]
    seg = S.spans(tokenizer, text, ranges)
    scores = rng.normal(size=(3, len(seg.input_ids))) * 10.0 ** rng.integers(-3, 4)
    got = seg.scores(scores)
    assert got.shape == (3, len(ranges))
    owner = seg.membership().argmax(1)
    inside = seg.membership().sum(1) == 1
    for b in range(3):
        for j in range(len(ranges)):
            mine = [scores[b, i] for i in range(len(seg.input_ids)) if inside[i] and owner[i] == j]
            assert math.isclose(got[b, j], math.fsum(mine), rel_tol=1e-13, abs_tol=1e-13)
        total = math.fsum(got[b]) + float(seg.outside_score(scores[b]))
        assert math.isclose(total, math.fsum(scores[b]), rel_tol=1e-12, abs_tol=1e-12)
    # every token is in at most one segment; a token whose characters lie inside a range is in that range's segment
    assert seg.membership().sum(1).max() <= 1
    for i, (a, b) in enumerate(seg.offsets):
        for j, (ra, rb) in enumerate(ranges):
            if ra <= a < b <= rb:
                assert inside[i] and owner[i] == j
    with pytest.raises(MixlensError, match="token scores"):
        seg.scores(scores[:, :-1])


def test_ranked_orders_segments_by_score(tokenizer):
    seg = S.passages(tokenizer, "alpha | beta | gamma", "|")
    token = np.zeros(len(seg.input_ids))
    token[seg.segments[1].start] = 2.0
    token[seg.segments[2].start] = 1.0
    token[0] = 5.0  # [CLS]: outside every segment, not ranked
    assert seg.ranked(token) == [("passage 2", 2.0), ("passage 3", 1.0), ("passage 1", 0.0)]
