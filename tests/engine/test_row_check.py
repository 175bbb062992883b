"""The per-run reconstruction check in row mode (long causal inputs, `rows="last"`): every piece of the decomposition
that row mode computes — α's rows, the value vectors, W_O, b_O, the residual and the norm after the attention residual
sum — is checked against the model's own tensors at the rows it uses, each row's error relative to that row's size.
A single piece 10 % off is refused at 256 and 1,024 tokens, in float32 and bfloat16, streamed or not, and the probe
of unknown model types (`mixlens.layouts`) uses the same per-row check."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch
import transformers as T

import mixlens
import mixlens.trace as trace_module
from mixlens.adapters import Norm
from mixlens.errors import ReconstructionError
from mixlens.methods import norms
from mixlens.pipeline import run_methods
from tests.conftest import _SMALL, random_model

# the llama layout (RMSNorm, grouped KV), the same with value and query/key biases (qwen2), the gpt2 layout
# (LayerNorm, fused q | k | v, output bias)
EXTRA = {"qwen2": lambda: T.Qwen2Config(num_key_value_heads=2, **_SMALL)}
PIECES = ("W_O", "W_V", "value bias", "LN weight", "residual", "b_O")
_HELD: list[torch.Tensor] = []  # every wrong weight made, kept (the engine now also tells replaced tensors apart:
# tests/engine/test_weight_cache.py)


def row_model(family: str, tokenizer) -> torch.nn.Module:
    """A random causal LM of `family` (llama, qwen2 or gpt2; positions for 2,048 tokens) with its biases and norm
    weights moved off their initial values."""
    if family in EXTRA:
        torch.manual_seed(0)
        cfg = EXTRA[family]()
        cfg.vocab_size, cfg.pad_token_id = tokenizer.vocab_size, tokenizer.pad_token_id
        model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    else:
        model = random_model(family, tokenizer, head="AutoModelForCausalLM", n_positions=2048)
    with torch.no_grad():  # biases and norm weights off their initial 0 and 1 (biases as large as the weights)
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
    return model


def _lens(family: str, tokenizer, dtype: str, monkeypatch) -> mixlens.Lens:
    monkeypatch.setattr(tokenizer, "model_max_length", 4096)
    return mixlens.Lens(row_model(family, tokenizer), tokenizer, dtype=dtype)


def long_text(n: int) -> str:
    """A text of over n tokens."""
    return " ".join(["the cat sat on a mat while the dog ran off"] * (n // 11 + 1))


@contextlib.contextmanager
def _traced(layer: int, change: Callable[[trace_module.LayerTrace], dict]) -> Iterator[None]:
    """Every trace's layer `layer` as the decomposition reads it, with the fields `change` returns replaced (what a
    misread capture point gives: the trace reads v, x, ... where the layout says they are)."""
    real = trace_module._layer_trace

    def wrong(adapter, rec, k):
        lt = real(adapter, rec, k)
        return dataclasses.replace(lt, **change(lt)) if k == layer else lt

    trace_module._layer_trace = wrong
    try:
        yield
    finally:
        trace_module._layer_trace = real


@contextlib.contextmanager
def broken(lens: mixlens.Lens, piece: str, by: float = 0.1, layer: int = 1) -> Iterator[None]:
    """The decomposition's reading of one piece of layer `layer` off the model's by `by` (relative):
    W_O, b_O and the norm's γ as the adapter holds them; the value vectors (as a W_V `by` off gives them), a value bias
    (a shift of every value vector by `by` of their mean size) and the residual x as the trace captures them."""
    lay = lens.adapter.layers[layer]
    if piece in ("W_O", "b_O"):
        field = "raw_w_o" if piece == "W_O" else "raw_b_o"
        own = getattr(lay, field)
        _HELD.append(own * (1 + by))
        setattr(lay, field, _HELD[-1])
        try:
            yield
        finally:
            setattr(lay, field, own)
        return
    if piece == "LN weight":  # the same module (the trace's hooks are on it), read with γ off
        own_norm = lay.ln_mix
        _HELD.append(own_norm.weight * (1 + by))
        wrong = _HELD[-1]

        class Off(Norm):
            @property
            def weight(self) -> torch.Tensor:
                return wrong

        lay.ln_mix = Off(own_norm.module, own_norm.rms, own_norm.offset, identity=own_norm.identity)
        try:
            yield
        finally:
            lay.ln_mix = own_norm
        return
    change = {
        "W_V": lambda lt: {"value": lt.value * (1 + by)},
        "value bias": lambda lt: {"value": lt.value + by * lt.value.abs().mean((2, 3), keepdim=True)},
        "residual": lambda lt: {"x": lt.x * (1 + by)},
    }[piece]
    with _traced(layer, change):
        yield


def _refused(run: Callable[[], object]) -> str | None:
    try:
        run()
    except ReconstructionError as e:
        return str(e)
    return None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [256, 1024])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_row_mode_refuses_each_piece_ten_percent_off(family, n, dtype, tokenizer, monkeypatch):
    """Streamed row mode (`analyze(rows="last")`): the clean run passes well within the tolerance; each piece 10 %
    off is refused, naming layer 1."""
    lens = _lens(family, tokenizer, dtype, monkeypatch)
    text = long_text(n)
    res = lens.analyze([text], ["norm"], max_length=n, rows="last")
    assert res["norm"].rows == [[n - 1]]
    assert res.error_share is not None and float(res.error_share.max()) <= 0.5
    for piece in PIECES:
        if piece == "b_O" and lens.adapter.layers[1].raw_b_o is None:
            continue
        with broken(lens, piece):
            why = _refused(lambda: lens.analyze([text], ["norm"], max_length=n, rows="last"))
        assert why is not None and why.startswith("layer 1:"), (piece, why)


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "torch"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_row_mode_trace_not_streamed_is_checked_the_same(family, compiled, tokenizer, monkeypatch):
    """A trace that keeps q and K (`qk_rows`), then `run_methods(rows="last")`: the same per-row check (both engine
    paths)."""
    monkeypatch.setattr(norms, "COMPILED", compiled)
    lens = _lens(family, tokenizer, "bfloat16", monkeypatch)
    enc = lens.encode([long_text(256)], max_length=256)
    run_methods(lens.trace(enc, qk_rows=True), ["norm"], rows="last")
    for piece in ("W_O", "value bias", "residual"):
        with broken(lens, piece):
            tr = lens.trace(enc, qk_rows=True)
            why = _refused(lambda tr=tr: run_methods(tr, ["norm"], rows="last"))
        assert why is not None and why.startswith("layer 1:"), (piece, why)


def test_the_check_rows_are_the_targets_and_seeded_rows_of_real_tokens():
    mask = torch.tensor([[True] * 10, [True] * 4 + [False] * 6])
    rows = norms.check_positions(mask, torch.tensor([[9], [3]]))
    assert rows.shape == (2, 1 + norms.CHECK_ROWS) and rows[:, 0].tolist() == [9, 3]
    assert (rows[0] < 10).all() and (rows[1] < 4).all()
    assert torch.equal(rows, norms.check_positions(mask, torch.tensor([[9], [3]])))  # seeded
    assert norms.check_positions(mask, None)[:, 0].tolist() == [9, 3]  # full maps: the last token, then drawn rows


def test_a_wrong_attention_output_far_from_the_target_row_is_refused(tokenizer, monkeypatch):
    """A piece wrong only at rows other than the target (here the attention output of every token but the last)
    is still refused: the check covers seeded rows besides the targets."""
    lens = _lens("llama", tokenizer, "float32", monkeypatch)
    text = long_text(256)
    norm = lens.adapter.layers[1].ln_mix

    def change(lt):
        out = lt.attn_out.clone()
        out[:, :-1] *= 1.1
        y = lt.x + out  # a consistent stream: only α v W_O no longer matches
        return {"attn_out": out, "mix_in": y, "mix_out": norm.project(y) / norm.scale(y)[..., None] + norm.shift()}

    with _traced(1, change):
        why = _refused(lambda: lens.analyze([text], ["norm"], max_length=256, rows="last"))
    assert why is not None and "attention output rebuilt" in why, why


def test_the_row_error_is_relative_to_each_row():
    real = torch.tensor([[1000.0, 0.0], [0.01, 0.0]])
    rebuilt = torch.tensor([[1000.0, 0.0], [0.011, 0.0]])
    assert norms.row_error(rebuilt, real).tolist() == pytest.approx([0.0, 0.1], rel=1e-4)
    assert norms.row_error(rebuilt, real, torch.ones(2))[1] == pytest.approx(1e-3, rel=1e-3)
    assert norms.row_error(torch.full((2,), float("nan")), torch.ones(2)).isnan()


def test_the_attention_row_size_is_the_part_given_to_tokens():
    """The size of an attention output's row is ‖o − b_O‖ (W_O's part), not ‖o‖: a bias that dominates the output
    does not hide a wrong W_O; in bfloat16 at least the model's own rounding of ‖o‖ is allowed."""
    real, b_o, stream = torch.tensor([[10.0, 1.0]]), torch.tensor([10.0, 0.0]), torch.tensor([[100.0, 0.0]])
    assert norms.attn_row_size(real, b_o, stream, torch.float32).item() == pytest.approx(1.0)
    assert norms.attn_row_size(real, None, stream, torch.float32).item() == pytest.approx(101**0.5)
    rounding = norms.ROUNDINGS * 2**-8 / norms.ATTN_TOLERANCES[torch.bfloat16] * 101**0.5
    assert norms.attn_row_size(real, b_o, stream, torch.bfloat16).item() == pytest.approx(max(1.0, rounding))
    assert norms.attn_row_size(0 * real, None, stream, torch.float32).item() == pytest.approx(norms.ROW_FLOOR * 100)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_layout_probe_refuses_a_layout_with_w_o_ten_percent_off(dtype, tokenizer, monkeypatch):
    """An unknown model type read under a layout whose W_O is 10 % off the model's is not used: the probe (the same
    per-row check) names the layer and the attention output; with the right W_O the layout passes."""
    from mixlens import layouts
    from mixlens.adapters import family_named, resolve
    from tests.engine.test_layouts import UNKNOWN
    from tests.engine.test_layouts import _model as unknown_model

    model = unknown_model(UNKNOWN["helium"][0], tokenizer).to(getattr(torch, dtype))
    adapter, note = layouts.adapt(model, tokenizer)
    assert adapter.family.name == "llama" and note is not None

    def off(model, fam):
        adapter = resolve(model, fam)
        adapter.layers[1].raw_w_o = adapter.layers[1].raw_w_o * 1.1
        return adapter

    monkeypatch.setattr(layouts, "resolve", off)
    miss = layouts.probe(off(model, family_named("llama")), model, tokenizer)
    assert miss is not None and (miss.layer, miss.piece) == (1, "attention output"), miss
    assert miss.error == pytest.approx(0.1, rel=0.05)
    with pytest.raises(mixlens.MixlensError, match="closest: llama \\(layer 1, attention output: differs by 0.1"):
        layouts.adapt(model, tokenizer)


def test_a_padded_batch_is_checked_at_each_inputs_own_rows(tokenizer, monkeypatch):
    """Inputs of different lengths in one right-padded batch: each input's check rows are among its real tokens
    (padding is never checked, and never passes a wrong piece)."""
    lens = _lens("llama", tokenizer, "bfloat16", monkeypatch)
    texts = [long_text(256), long_text(60)]
    res = lens.analyze(texts, ["norm"], max_length=256, rows="last", batch_size=2)
    assert res.error_share is not None and float(res.error_share.max()) <= 0.5
    assert res["norm"].rows == [[255], [len(res.tokens[1]) - 1]]
    with broken(lens, "W_O"):
        why = _refused(lambda: lens.analyze(texts, ["norm"], max_length=256, rows="last", batch_size=2))
    assert why is not None and why.startswith("layer 1:"), why
