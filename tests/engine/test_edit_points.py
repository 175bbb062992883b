"""Named edit points and the start/stop options of the capture context (mixlens.trace)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from mixlens.errors import MixlensError
from mixlens.trace import BLOCK_POINTS, hooked
from tests.conftest import SENTENCES, random_lens


def _all_points(n_layers: int) -> list[str]:
    return ["embed", *(f"blocks.{layer}.{p}" for layer in range(n_layers) for p in BLOCK_POINTS)]


def _expected_shape(lens, enc, name: str) -> tuple[int, ...]:
    b, n = enc.inputs["input_ids"].shape
    lay = lens.adapter.layers[0]
    d = lay.w_o.shape[1]
    if name == "embed":
        return (b, n, lens.adapter.base.get_input_embeddings().weight.shape[1])
    return {
        "resid_pre": (b, n, d),
        "attn.v": (b, lay.n_kv_heads, n, lay.d_head),
        "attn.pattern": (b, lay.n_heads, n, n),
        "attn.z": (b, lay.n_heads, n, lay.d_head),
    }[name.split(".", 2)[2]]


def test_each_edit_point_fires_once_per_layer_with_its_shape(family_lens):
    enc = family_lens.encode(SENTENCES)
    shapes: dict[str, list[tuple[int, ...]]] = defaultdict(list)

    def spy(name: str):
        def fn(t: torch.Tensor) -> torch.Tensor:
            shapes[name].append(tuple(t.shape))
            return t

        return fn

    names = _all_points(family_lens.adapter.n_layers)
    with torch.no_grad():
        plain = family_lens.trace(enc)
        spied = family_lens.trace(enc, edits={name: spy(name) for name in names})
    for name in names:
        assert shapes[name] == [_expected_shape(family_lens, enc, name)], name
    # identity edits change nothing (with pattern/z edited, the engine forms α v itself)
    for a, b in zip(plain.layers, spied.layers, strict=True):
        torch.testing.assert_close(b.out, a.out, atol=1e-6, rtol=1e-5)


def test_edit_points_are_keyed_by_the_real_layer(family_lens):
    """An edit of layer l changes layer l on (what it edits) and nothing before it."""
    enc = family_lens.encode(SENTENCES)
    last = family_lens.adapter.n_layers - 1
    with torch.no_grad():
        plain = family_lens.trace(enc)
        tr = family_lens.trace(
            enc, edits={f"blocks.{last}.resid_pre": lambda x: 2 * x, f"blocks.{last}.attn.v": torch.zeros_like}
        )
    for a, b in zip(plain.layers[:last], tr.layers[:last], strict=True):
        assert torch.equal(a.x, b.x) and torch.equal(a.out, b.out)
    assert torch.equal(tr.layers[last].x, 2 * plain.layers[last].x)
    assert tr.layers[last].value.abs().max() == 0 and plain.layers[last].value.abs().max() > 0


def test_embed_edit_replaces_the_word_embeddings(family_lens):
    """Replacing the `embed` output by the module's own output is the identity; adding δ changes layer 0's input
    exactly as the same δ added to the token embedding rows would."""
    enc = family_lens.encode(SENTENCES)
    emb = family_lens.adapter.base.get_input_embeddings()
    delta = 0.1 * torch.randn(
        *enc.inputs["input_ids"].shape, emb.weight.shape[1], generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        plain = family_lens.trace(enc)
        own = emb(enc.inputs["input_ids"])
        same = family_lens.trace(enc, edits={"embed": lambda _: own})
        moved = family_lens.trace(enc, edits={"embed": lambda e: e + delta})
    assert torch.equal(same.layers[0].x, plain.layers[0].x)
    assert not torch.allclose(moved.layers[0].x, plain.layers[0].x)


def test_start_at_layer_reproduces_the_later_layers_exactly(family_lens):
    enc = family_lens.encode(SENTENCES)
    n = family_lens.adapter.n_layers
    with torch.no_grad():
        tr = family_lens.trace(enc)
        ref = family_lens.model(**enc.inputs).last_hidden_state
        for start in range(n):
            with hooked(family_lens.adapter, start=start, resid_pre=tr.layers[start].x) as rec:
                out = family_lens.model(**enc.inputs).last_hidden_state
            assert len(rec["alpha"]) == n - start  # the layers before `start` do not run
            for k, layer in enumerate(range(start, n)):
                for key in ("x", "alpha", "value", "mix_out", "out"):
                    assert torch.equal(rec[key][k], getattr(tr.layers[layer], key)), (start, layer, key)
            assert torch.equal(out, ref)


def test_stop_after_layer_and_one_layer_alone(family_lens):
    enc = family_lens.encode(SENTENCES)
    n = family_lens.adapter.n_layers
    with torch.no_grad():
        tr = family_lens.trace(enc)
        ran_on = False
        with hooked(family_lens.adapter, stop_after=0) as rec:
            family_lens.model(**enc.inputs)
            ran_on = True
        assert not ran_on and len(rec["out"]) == 1 and torch.equal(rec["out"][0], tr.layers[0].out)
        for layer in range(n):  # layer l alone on its captured input (what value zeroing runs)
            with hooked(family_lens.adapter, start=layer, resid_pre=tr.layers[layer].x, stop_after=layer) as rec:
                family_lens.model(**enc.inputs)
            assert len(rec["alpha"]) == 1 and torch.equal(rec["out"][0], tr.layers[layer].out)
        with hooked(family_lens.adapter, stop_after=n - 1, stop_at_mix=True) as rec:
            family_lens.model(**enc.inputs)
        assert len(rec["out"]) == n - 1 and torch.equal(rec["mix_out"][-1], tr.layers[-1].mix_out)


@pytest.fixture(scope="module")
def small(tokenizer):
    return random_lens("bert", tokenizer)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (
            {"edits": {"blocks.0.attn.q": None}},
            r"unknown edit point 'blocks.0.attn.q'; valid: embed, "
            r"blocks.\{l\}.resid_pre, .*attn.z \(l = 0..1\)",
        ),
        ({"edits": {"embeds": None}}, "unknown edit point 'embeds'"),
        ({"edits": {"blocks.0.resid_pre.x": None}}, "unknown edit point"),
        ({"edits": {"blocks.2.attn.v": None}}, r"layer 2 out of range in edit point 'blocks.2.attn.v'"),
        ({"edits": {"blocks.0.attn.v": None}, "start": 1, "x": True}, r"outside the layers run \(1..1\)"),
        ({"edits": {"blocks.1.attn.z": None}, "stop_after": 0}, r"outside the layers run \(0..0\)"),
        ({"edits": {"embed": None}, "start": 1, "x": True}, "'embed' is not run"),
        ({"start": 2, "x": True}, r"start layer 2 out of range; the model has 2 layers \(0..1\)"),
        ({"start": -1}, "start layer -1 out of range"),
        ({"start": 1}, "start=1 needs resid_pre"),
        ({"stop_after": 2}, r"stop_after layer 2 out of range; valid: 0..1"),
        ({"start": 1, "stop_after": 0, "x": True}, r"stop_after layer 0 out of range; valid: 1..1"),
    ],
)
def test_bad_edit_points_and_layer_ranges_are_refused(small, kwargs, msg):
    kwargs = dict(kwargs)
    x = torch.zeros(1, 3, 64) if kwargs.pop("x", False) else None
    with pytest.raises(MixlensError, match=msg), hooked(small.adapter, resid_pre=x, **kwargs):
        pass


def test_trace_refuses_unknown_edit_points(small):
    with pytest.raises(MixlensError, match="unknown edit point 'blocks.0.attn'"):
        small.trace(small.encode(SENTENCES), edits={"blocks.0.attn": lambda t: t})


def test_one_model_call_per_context(small):
    enc = small.encode(SENTENCES)
    with torch.no_grad(), pytest.raises(RuntimeError, match="one model call per hooked"), hooked(small.adapter):
        small.model(**enc.inputs)
        small.model(**enc.inputs)


@pytest.mark.parametrize("groups", [1, 2])
def test_albert_shared_layers_are_told_apart(tokenizer, groups):
    """ALBERT calls one module for several layers: edits still reach exactly their layer, and start/stop work."""
    lens = random_lens("albert", tokenizer, num_hidden_layers=4, num_hidden_groups=groups)
    assert len({id(lay.module) for lay in lens.adapter.layers}) == groups
    enc = lens.encode(SENTENCES)
    with torch.no_grad():
        plain = lens.trace(enc)
        tr = lens.trace(enc, edits={"blocks.1.attn.v": torch.zeros_like})
        assert torch.equal(tr.layers[0].out, plain.layers[0].out) and torch.equal(tr.layers[1].x, plain.layers[1].x)
        assert tr.layers[1].value.abs().max() == 0 and tr.layers[2].value.abs().max() > 0
        assert not torch.allclose(tr.layers[1].out, plain.layers[1].out)
        for start in range(4):
            with hooked(
                lens.adapter, start=start, resid_pre=plain.layers[start].x, stop_after=min(3, start + 1)
            ) as rec:
                lens.model(**enc.inputs)
            assert len(rec["out"]) == min(3, start + 1) - start + 1
            for k, out in enumerate(rec["out"]):
                assert torch.equal(out, plain.layers[start + k].out)
