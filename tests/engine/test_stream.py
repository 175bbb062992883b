"""Row streaming (`pipeline.stream_trace`): each layer is consumed inside the forward pass and its α dropped;
the results equal the rows of full mode, and the trace holds layers · n · K (plus n² per layer for a rollout)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mixlens
import mixlens.methods.norms as norms
from mixlens.errors import MixlensError, ReconstructionError
from mixlens.methods import get as get_method
from mixlens.methods.registry import refused_by, with_row_mode
from mixlens.methods.rollout import row_normalize
from mixlens.pipeline import LayerStream, resolve_rows, run_methods, stream_trace
from mixlens.rowattn import LazyMask, QKRows
from mixlens.trace import LayerTrace
from tests.conftest import SENTENCES, random_lens
from tests.real_models.test_real_models import CHECKPOINTS, model_dir

# post-LN, causal pre-LN (LayerNorm, RMS), sandwich, ALiBi (α kept whole), parallel multi-query
FAMILIES = ["bert", "gpt2", "llama", "mpnet", "gemma3_text", "bloom", "falcon"]


def _rows(full: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows [B, K] of the target axis (third from the end) of [B, ..., n, n] → [B, ..., K, n]."""
    idx = rows.view(rows.shape[0], *[1] * (full.dim() - 3), rows.shape[1], 1)
    return full.gather(-2, idx.expand(*full.shape[:-2], rows.shape[1], full.shape[-1]))


def _stream(lens, enc, methods, spec):
    return stream_trace(lens.adapter, lens.model, enc.inputs, methods, spec, lens.tokenizer)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_rows_equal_the_rows_of_full_mode(family, compiled, tokenizer, monkeypatch):
    monkeypatch.setattr(norms, "COMPILED", compiled)
    lens = random_lens(family, tokenizer)
    methods = [m for m in with_row_mode() if m not in refused_by(lens.adapter.family)]
    enc = lens.encode(SENTENCES)  # three lengths: a padded batch
    full = run_methods(lens.trace(enc, ffn=True), methods)
    heads_full = run_methods(lens.trace(enc), ["attention", "norm"], heads=True).values
    for spec in ("last", [0, -1, 2]):
        tr = _stream(lens, enc, methods, spec)
        assert all(lt.alpha.numel() == 0 for lt in tr.layers)  # every layer's α was consumed and dropped
        rows = resolve_rows(spec, tr.lengths)
        got = run_methods(tr, methods, rows=spec)
        for m in methods:
            want = _rows(full.values[m], rows)
            assert got.values[m].shape == want.shape, m
            torch.testing.assert_close(got.values[m], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=m)
        assert got.norms is not None and full.norms is not None
        for view, r in full.norms.ratio.items():  # per-token quantities cover every token
            torch.testing.assert_close(got.norms.ratio[view], r, rtol=1e-5, atol=1e-6, msg=view)
        torch.testing.assert_close(got.norms.scale, full.norms.scale)
        torch.testing.assert_close(got.norms.f_norm, full.norms.f_norm)
        assert float(got.norms.error.max()) <= norms.TOLERANCE * 100
        tr = _stream(lens, enc, ["attention", "norm"], spec)
        for m, v in run_methods(tr, ["attention", "norm"], heads=True, rows=spec).values.items():
            torch.testing.assert_close(v, _rows(heads_full[m], rows), rtol=1e-5, atol=1e-6, msg=m)


def _held(obj: object, seen: dict[int, torch.Tensor], depth: int = 0) -> None:
    """Every tensor reachable from `obj` through closures, LayerTraces, QKRows and lists (by storage)."""
    if depth > 8 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        if obj.numel():
            seen[obj.untyped_storage().data_ptr()] = obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _held(o, seen, depth + 1)
    elif isinstance(obj, (LayerTrace, QKRows, LazyMask)):
        for f in dataclasses.fields(obj):
            _held(getattr(obj, f.name), seen, depth + 1)
    elif callable(obj) and getattr(obj, "__closure__", None):
        for cell in obj.__closure__:
            _held(cell.cell_contents, seen, depth + 1)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_the_trace_holds_target_rows_and_one_n_squared_matrix_per_rollout(family, tokenizer):
    """Bytes held after the forward pass: α rows (layers · H · K · n), no α; a rollout adds its layers · n² matrices,
    or in row mode (causal LMs) per layer q, K and the softmax normaliser (+ v, the residual sum and the self pairs
    for ALTI) and the one additive mask the layers share. While the forward pass runs, only the running layer's α is
    alive."""
    lens = random_lens(family, tokenizer)
    enc = lens.encode(["a b c d e f g h i j k l"])
    layers, heads, n = lens.adapter.n_layers, lens.adapter.layers[0].n_heads, enc.inputs["input_ids"].shape[1]
    lay, d = lens.adapter.layers[0], lens.model.config.hidden_size
    kv = lens.model.config.num_key_value_heads if family == "llama" else heads
    qk = (heads + kv) * n * lay.d_head * 4 + heads * n * 4  # per layer, row mode
    alive: list[int] = []
    call = LayerStream.__call__

    def spy(self, index, lt):
        alive.append(len(self.memo.layer_rows.get("alpha", [])))  # the layers consumed before this one
        call(self, index, lt)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LayerStream, "__call__", spy)
        for methods, mats in (
            (["norm", "norm_res", "norm_resln"], 0),
            (["norm_res", "globenc_rollout"], 1),
            (["alti_rollout", "attention_rollout"], 2),
        ):
            alive.clear()
            tr = _stream(lens, enc, methods, "last")
            assert alive == list(range(layers))
            fields = ("x", "alpha", "value", "attn_out", "mix_in", "mix_out", "out")
            assert sum(getattr(lt, f).numel() for lt in tr.layers for f in fields) == 0  # every layer consumed
            held = {k: sum(t.nbytes for t in v) for k, v in tr.memo.layer_rows.items()}
            assert held == {"alpha": layers * heads * 1 * n * 4}
            seen: dict[int, torch.Tensor] = {}
            _held(list(tr.memo.layer_fns.values()), seen)  # the factories: what waits for the propagation
            held_bytes = sum(t.untyped_storage().nbytes() for t in seen.values())
            if lens.adapter.family.causal:
                assert all(t.shape[-2:] != (n, n) for t in seen.values())  # no n × n: the mask is lazy
                alti = (n * d + kv * n * lay.d_head + n) * 4 if "alti_rollout" in methods else 0  # y, v, self pairs
                want = mats and layers * (qk + alti) + n + 8  # + the lazy mask's bool padding and batch index
                assert held_bytes == want, (methods, held_bytes, want)
            else:
                assert held_bytes == mats * layers * n * n * 4
            run_methods(tr, methods, rows="last")


def test_the_per_run_check_runs_on_a_streamed_trace(tokenizer, monkeypatch):
    lens = random_lens("llama", tokenizer)
    enc = lens.encode(SENTENCES[:1])
    monkeypatch.setattr(norms, "tolerance", lambda model, float32=None: -1.0)  # every layer misses it
    for methods in (["norm"], ["globenc_rollout"]):  # GlobEnc of a pre-LN model is N-Res: the norm engine runs
        tr = _stream(lens, enc, methods, "last")
        with pytest.raises(ReconstructionError, match="layer 0"):
            run_methods(tr, methods, rows="last")


def test_a_streamed_trace_refuses_other_methods_and_rows(tokenizer):
    lens = random_lens("gpt2", tokenizer)
    enc = lens.encode(SENTENCES[:1])
    tr = _stream(lens, enc, ["norm"], "last")
    for methods, spec in ((["alti"], "last"), (["norm"], [0]), (["norm"], None)):
        with pytest.raises(MixlensError, match="streamed for methods norm"):
            run_methods(tr, methods, rows=spec)
    with pytest.raises(MixlensError, match="'value_zeroing' cannot compute some rows"):
        _stream(lens, enc, ["value_zeroing"], "last")
    with pytest.raises(MixlensError, match="rows other than 'all'"):
        _stream(lens, enc, ["norm"], "all")


def test_analyze_streams_rows(tokenizer, monkeypatch):
    """`lens.analyze(rows=...)` takes the streaming path, and its rows equal full mode's."""
    lens = random_lens("llama", tokenizer)
    calls: list[int] = []
    call = LayerStream.__call__
    monkeypatch.setattr(LayerStream, "__call__", lambda self, i, lt: (calls.append(i), call(self, i, lt)))
    methods = ["norm_resln", "globenc_rollout", "alti_rollout"]
    full = lens.analyze(SENTENCES, methods)
    assert not calls
    got = lens.analyze(SENTENCES, methods, rows="last")
    assert calls
    for m in methods:
        for b, toks in enumerate(got.tokens):
            want = full[m].input(b)[:, [len(toks) - 1]]
            torch.testing.assert_close(torch.from_numpy(got[m].input(b)), torch.from_numpy(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_streamed_rows_on_real_checkpoints(name):
    """Real checkpoints (skipped when not fetched): streamed rows equal full mode's, the per-run check passes."""
    lens = mixlens.load(model_dir(name), head="base")
    methods = [m for m in with_row_mode() if m not in refused_by(lens.adapter.family)]
    enc = lens.encode(SENTENCES)
    # unnormalised, 30 layers of N-Res overflow float32
    opts = {"globenc_rollout": {"normalize": True}} if "globenc_rollout" in methods else {}
    full = run_methods(lens.trace(enc, ffn=True), methods, options=opts).values
    tr = _stream(lens, enc, methods, [1, -1])
    got = run_methods(tr, methods, options=opts, rows=[1, -1])
    assert got.norms is not None
    rows = resolve_rows([1, -1], tr.lengths)
    for m in methods:
        want, have = _rows(full[m], rows), got.values[m]
        if get_method(m).unnormalised:  # exact up to a power of two per layer (full) or row (rows): `in_range`
            want, have = row_normalize(want), row_normalize(have)
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()), msg=m)


def test_long_inputs_report_progress_per_layer(tokenizer):
    """`on_layer` sees every layer of the forward pass, then every layer of each rollout's row propagation."""
    lens = random_lens("llama", tokenizer)
    seen: list[tuple[str, int, int]] = []
    lens.analyze(["a b c d e f"], ["norm", "globenc_rollout"], rows="last", on_layer=lambda *a: seen.append(a))
    layers = lens.adapter.n_layers
    forward = [("forward pass", k, layers) for k in range(1, layers + 1)]
    assert seen == forward + [("propagating the target rows", k, layers) for k in range(1, layers + 1)]
