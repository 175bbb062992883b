"""Core engine: exactness on every family, batching, known answers on hand-built models."""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T

import mixlens
import mixlens.stats.mixing
from mixlens.errors import ReconstructionError
from mixlens.methods._compiled import parallel, row_splits, run_lists, run_stages
from mixlens.methods.norms import RATIO_VARIANTS
from mixlens.methods.reference import decompose
from tests.conftest import SENTENCES, random_lens, random_model

METHODS = ["attention", "norm", "norm_res", "norm_resln"]


def applicable(lens: mixlens.Lens) -> list[str]:
    """METHODS less those the family refuses (OLMo 2: norm_resln; test_capabilities.py tests the refusal)."""
    return [m for m in METHODS if mixlens.methods.get(m).refusal(lens.adapter.family) is None]


def assert_exact(lens: mixlens.Lens) -> None:
    """The engine's maps, per-head norms, ratios, scale and bias term equal the explicit vectors of the package
    reference (`methods.reference`), which itself rebuilds the real norm inputs and outputs."""
    tr = lens.trace(SENTENCES)
    bn = mixlens.methods.norms.block_norms(tr)
    ref = decompose(tr)
    assert bn.error.max() <= 1e-4 and ref.error.max() <= 1e-4
    m = tr.mask
    close = dict(atol=1e-4, rtol=1e-4)
    for key in ("n", "n_res", "n_resln"):
        torch.testing.assert_close(getattr(bn, key), getattr(ref, key), **close, msg=key)
    torch.testing.assert_close(bn.f_norm, ref.f.norm(dim=-1), **close)
    torch.testing.assert_close(mixlens.methods.get("norm")(tr, heads=True), ref.n_head, **close)
    torch.testing.assert_close(bn.scale, ref.s, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bn.bias, ref.bias, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixlens.methods.get("attention")(tr), ref.w.mean(2), atol=1e-6, rtol=0)
    for v in RATIO_VARIANTS:
        torch.testing.assert_close(bn.ratio[v], ref.ratio[v], atol=1e-4, rtol=0, msg=v)
    assert not torch.any(bn.n_resln * ~(m[:, None, :, None] & m[:, None, None, :]))  # padding stays 0


def small_blocks(monkeypatch, compiled: bool) -> None:
    """Engine settings that exercise every path on small inputs."""
    monkeypatch.setattr(mixlens.methods.norms, "COMPILED", compiled)
    monkeypatch.setattr(mixlens.methods.norms, "TOKEN_BLOCK", 7)  # several token blocks (jobs), the last one partial
    monkeypatch.setattr(mixlens.methods._compiled, "PAIRS_PER_CALL", 5)  # many row ranges, on several threads


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "torch"])
def test_every_family_equals_the_reference(family_lens, compiled, monkeypatch):
    """Both implementations of the passes (compiled CPU kernels, plain torch for other devices) are exact."""
    small_blocks(monkeypatch, compiled)
    assert_exact(family_lens)


@pytest.mark.parametrize(
    ("family", "heads", "overrides"),
    [
        ("bert", 1, {}),
        ("bert", 3, {}),
        ("bert", 5, {}),
        ("llama", 3, {"num_key_value_heads": 1}),  # causal rows, grouped values
    ],
)
def test_odd_head_counts_equal_the_reference(tokenizer, family, heads, overrides, monkeypatch):
    """The compiled attention pass walks head pairs in 2 × 2 blocks: an odd head count (SmolLM2 has 9) ends on a
    half block that must add nothing but its own pairs."""
    small_blocks(monkeypatch, True)
    assert_exact(random_lens(family, tokenizer, hidden_size=16 * heads, num_attention_heads=heads, **overrides))


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "torch"])
def test_bundled_model_equals_the_reference(bundled, compiled, monkeypatch):
    small_blocks(monkeypatch, compiled)
    assert_exact(bundled)


@pytest.mark.parametrize("causal", [False, True])
def test_row_splits_partition_the_rows(causal, monkeypatch):
    """The attention pass's row ranges cover every row once, in order, with about equal work."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(mixlens.methods._compiled, "PAIRS_PER_CALL", 50)
    lengths = np.array([17, 3, 20, 0])
    splits = row_splits(lengths, np.tile(np.arange(20), (4, 1)), causal)
    assert splits[0][0] == 0 and splits[-1][1] == 80
    assert all(a[1] == b[0] for a, b in zip(splits[:-1], splits[1:], strict=True))
    i = np.arange(20)
    cost = np.where(i < lengths[:, None], i + 1 if causal else lengths[:, None], 0).ravel()
    work = [int(cost[a:b].sum()) for a, b in splits]
    share = cost.sum() / (cost.sum() // 50)
    assert len(splits) >= cost.sum() // 50 - 1 and max(work) <= share + 20  # one row more than its share at most
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert row_splits(lengths, np.tile(np.arange(20), (4, 1)), causal) == [(0, 80)]


def _flushing() -> bool:
    """Whether the calling thread flushes subnormal floats to zero."""
    return bool(np.float32(1e-30) * np.float32(1e-10) == 0)


@pytest.fixture(params=["openmp", "pool"])
def team(request, monkeypatch):
    """`parallel` on torch's OpenMP threads (where this torch has a GNU OpenMP runtime) or on a pool of ours."""
    teams = mixlens.methods._compiled._TEAM
    if request.param == "openmp" and teams["gomp"] is None:
        pytest.skip("this torch has no GNU OpenMP runtime")
    if request.param == "pool":
        monkeypatch.setitem(teams, "gomp", None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    return request.param


def test_parallel_runs_every_call_and_raises_their_errors(team):
    out = np.zeros(40)
    flushed = np.zeros(40, bool)
    threads: set[int] = set()

    def fill(k: int) -> None:
        out[k] = k
        flushed[k] = _flushing()
        threads.add(threading.get_ident())

    assert not _flushing()
    parallel([(fill, k) for k in range(40)])
    assert out.tolist() == list(range(40)) and flushed.all()  # every call ran once, subnormals flushed
    assert not _flushing()  # the caller's mode is back
    torch.set_flush_denormal(True)
    try:
        parallel([(fill, k) for k in range(4)])
        assert _flushing()  # a caller that flushes keeps flushing
    finally:
        torch.set_flush_denormal(False)

    def fail(k: int) -> None:
        raise ValueError(f"call {k}")

    with pytest.raises(ValueError, match="call"):
        parallel([(fail, k) for k in range(4)])
    assert not _flushing()


def test_stages_run_their_then_calls_after_all_their_first_calls(team):
    """`run_stages`: a stage's `then` calls start only once all its `first` calls are done; other stages go on."""
    log: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def step(kind: str, stage: int, k: int) -> None:
        time.sleep(0.002 if kind == "first" else 0)
        with lock:
            log.append((kind, stage, k))

    stages = [
        ([(step, "first", s, k) for k in range(3 + s)], [(step, "then", s, k) for k in range(2)]) for s in range(4)
    ]
    stages.append(([], [(step, "then", 4, 0)]))  # nothing to wait for
    run_stages(stages)
    assert sorted(log) == sorted(call[1:] for first, then in stages for call in first + then)  # each once
    for s in range(4):
        last_first = max(i for i, (kind, st, _) in enumerate(log) if kind == "first" and st == s)
        first_then = min(i for i, (kind, st, _) in enumerate(log) if kind == "then" and st == s)
        assert last_first < first_then

    def fail(k: int) -> None:
        raise ValueError(f"call {k}")

    with pytest.raises(ValueError, match="call"):
        run_stages([([(fail, 0)], [(step, "then", 0, 0)]), ([(step, "first", 1, 0)], [])])


def test_lists_run_each_in_order_on_a_thread_of_its_own(team):
    """`run_lists`: every list once, its calls in order on one thread, subnormals flushed; errors raised."""
    log: list[tuple[int, int, int, bool]] = []
    lock = threading.Lock()

    def step(lst: int, k: int) -> None:
        time.sleep(0.001)
        with lock:
            log.append((lst, k, threading.get_ident(), _flushing()))

    run_lists([[(step, lst, k) for k in range(3)] for lst in range(4)])
    assert sorted((lst, k) for lst, k, _, _ in log) == [(lst, k) for lst in range(4) for k in range(3)]
    for lst in range(4):
        mine = [(k, th) for li, k, th, _ in log if li == lst]
        assert [k for k, _ in mine] == [0, 1, 2] and len({th for _, th in mine}) == 1
    assert all(flushed for *_, flushed in log) and not _flushing()

    def fail(k: int) -> None:
        raise IndexError(f"call {k}")  # not taken for "no list left"

    with pytest.raises(IndexError, match="call"):
        run_lists([[(fail, 0)], [(step, 9, 0)]])


def test_concurrent_callers_get_their_own_results(bundled, tokenizer, team, monkeypatch):
    """Python threads analysing at once get what a lone call gives: on two models (each thread starts its own team;
    transformers' attention entry stays wrapped until the last trace ends) and on one model (its traces take turns:
    its hooks see every call of its modules)."""
    small_blocks(monkeypatch, True)
    lenses = [bundled, random_lens("bert", tokenizer), bundled]
    alone = [lens.analyze(SENTENCES, ["norm_resln"])["norm_resln"] for lens in lenses]
    results: list = [None] * len(lenses)

    def analyse(k: int) -> None:
        for _ in range(3):
            results[k] = lenses[k].analyze(SENTENCES, ["norm_resln"])["norm_resln"]

    threads = [threading.Thread(target=analyse, args=(k,)) for k in range(len(lenses))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for got, want in zip(results, alone, strict=True):
        for k in range(len(SENTENCES)):
            np.testing.assert_array_equal(got.input(k), want.input(k))


def test_openmp_team_is_torchs_with_a_second_runtime_loaded():
    """Another library's GNU OpenMP runtime in the process (a system libgomp) does not hide torch's."""
    import ctypes
    import ctypes.util

    ours = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    other = ctypes.util.find_library("gomp")
    if mixlens.methods._compiled._TEAM["gomp"] is None or not ours.exists() or other is None:
        pytest.skip("needs torch's bundled libgomp and a system one")
    ctypes.CDLL(other)
    fn = mixlens.methods._compiled._openmp_team()
    assert fn is not None
    assert ctypes.cast(fn, ctypes.c_void_p).value == ctypes.cast(ctypes.CDLL(ours).GOMP_parallel, ctypes.c_void_p).value


def test_openmp_team_is_not_used_in_a_forked_child():
    """GNU OpenMP is not fork-safe: a forked child falls back to a pool of its own threads."""
    if mixlens.methods._compiled._TEAM["gomp"] is None:
        pytest.skip("this torch has no GNU OpenMP runtime")
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply(_child_team) == (True, 1.0)


def _child_team() -> tuple[bool, float]:
    out = np.zeros(1)
    parallel([(out.__setitem__, 0, 1.0), (int, 0)])
    return mixlens.methods._compiled._TEAM["gomp"] is None, float(out[0])


def test_kernels_are_exact_on_either_team(bundled, team, monkeypatch):
    """The compiled passes are exact on torch's OpenMP threads and on a pool of ours."""
    small_blocks(monkeypatch, True)
    assert_exact(bundled)


def test_target_features_ask_for_full_width_vectors_on_avx512_only():
    """An AVX-512 host gets its own features plus -prefer-256-bit; other hosts and a user's NUMBA_CPU_FEATURES are
    left as they are."""
    from mixlens.methods._numba import target_features

    assert target_features({"avx2": True, "avx512f": True, "xop": False}, None) == "+avx2,+avx512f,-xop,-prefer-256-bit"
    assert target_features({"avx2": True, "avx512f": False}, None) is None
    assert target_features({"avx512f": True}, "+avx2") == "+avx2"


_VECTOR_WIDTH = """
import re
import numpy as np
from mixlens.methods._numba import njit

@njit(fastmath=True)
def axpy(a, x, y):
    for k in range(x.shape[0]):
        y[k] += a * x[k]

x = np.ones(1024, np.float32)
axpy(np.float32(2), x, x.copy())
asm = "\\n".join(axpy.inspect_asm().values())
print(len(re.findall(r"zmm\\d+", asm)), len(re.findall(r"ymm\\d+", asm)))
"""


@pytest.mark.slow  # starts fresh processes
def test_kernels_use_512_bit_vectors_on_intel_avx512_tuning():
    """With LLVM's tuning for Sapphire Rapids (which prefers 256-bit vectors), mixlens' numba code uses 512-bit
    registers; with the host's plain features set by hand it would not (the reason for the setting)."""
    import os
    import subprocess
    import sys

    import llvmlite.binding as ll

    if not dict(ll.get_host_cpu_features()).get("avx512f"):
        pytest.skip("needs a CPU with AVX-512")

    def registers(**env: str) -> tuple[int, int]:
        out = subprocess.run(
            [sys.executable, "-c", _VECTOR_WIDTH],
            env={**os.environ, "NUMBA_CPU_NAME": "sapphirerapids", **env},
            capture_output=True,
            text=True,
            check=True,
        )
        zmm, ymm = map(int, out.stdout.split())
        return zmm, ymm

    zmm, _ = registers()
    assert zmm > 0
    zmm, ymm = registers(NUMBA_CPU_FEATURES=ll.get_host_cpu_features().flatten())
    assert zmm == 0 and ymm > 0


@pytest.mark.slow  # starts fresh processes
def test_importing_mixlens_changes_nothing_process_wide():
    """Importing the methods does not load an OpenMP runtime by hand; the engine finds torch's when it first runs.
    (numba's target features are set when the kernel modules are imported, because numba builds its code generator
    at the first `@njit` decoration: see `mixlens.methods._numba`.)"""
    import subprocess
    import sys

    code = (
        "import mixlens.methods\n"
        "from mixlens.methods import _compiled\n"
        "assert _compiled._TEAM == {}, _compiled._TEAM\n"
        "import mixlens\n"
        "mixlens.load().analyze(['a short text'], ['norm'])\n"
        "assert 'gomp' in _compiled._TEAM\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_partial_trace_stops_after_last_attention_block(family_lens):
    """to_output=False skips the last FFN and the head, and changes nothing the attention-block methods use."""
    enc = family_lens.encode(SENTENCES)
    full, part = family_lens.trace(enc), family_lens.trace(enc, to_output=False)
    assert part.logits is None and part.layers[-1].out is None and full.layers[-1].out is not None
    for a, b in zip(full.layers, part.layers, strict=True):
        for key in ("x", "alpha", "value", "attn_out", "mix_in", "mix_out"):
            assert torch.equal(getattr(a, key), getattr(b, key)), key
    for name in applicable(family_lens):
        assert torch.equal(mixlens.methods.get(name)(full), mixlens.methods.get(name)(part)), name


def test_left_padding_tokenizer_is_padded_right(tokenizer, monkeypatch):
    """Decoder tokenizers often pad left; batches are padded right anyway and the norm engine refuses
    anything else with a clear error."""
    lens = random_lens("llama", tokenizer)
    monkeypatch.setattr(lens.tokenizer, "padding_side", "left")
    enc = lens.encode(SENTENCES)
    m = enc.inputs["attention_mask"]
    assert bool(m[:, 0].all()) and int(m.sum()) < m.numel()
    assert mixlens.methods.norms.block_norms(lens.trace(enc)).error.max() <= 1e-4
    tr = lens.trace(enc)
    tr.inputs = {**tr.inputs, "attention_mask": m.flip(-1)}
    with pytest.raises(mixlens.errors.MixlensError, match="right-padded"):
        mixlens.methods.norms.block_norms(tr)


def test_causal_families_attend_backwards(tokenizer):
    for fam in ("gpt2", "llama"):
        res = random_lens(fam, tokenizer).analyze(SENTENCES[:1], ["norm_resln"])
        v = res["norm_resln"].input(0)
        assert np.all(np.triu(v, k=1) == 0) and np.all(np.diagonal(v, axis1=-2, axis2=-1) > 0)


@pytest.mark.parametrize("heads", [False, True])
def test_batched_equals_unbatched(family_lens, heads):
    methods = applicable(family_lens)
    batched = family_lens.analyze(SENTENCES, methods, heads=heads)
    for b, text in enumerate(SENTENCES):
        single = family_lens.analyze([text], methods, heads=heads)
        for name in methods:
            np.testing.assert_allclose(batched[name].input(b), single[name].input(0), atol=1e-5)
        for v in batched.ratios:
            np.testing.assert_allclose(batched.mixing_ratio(v)[b], single.mixing_ratio(v)[0], atol=1e-5)


def test_padding_is_zero_and_shapes(bundled):
    res = bundled.analyze(SENTENCES, METHODS, heads=True)
    n = max(len(t) for t in res.tokens)
    assert res["attention"].values.shape == (3, 6, 12, n, n)
    assert res["norm_res"].values.shape == (3, 6, n, n)
    short = len(res.tokens[2])
    assert np.all(res["norm_resln"].values[2, :, short:, :] == 0)
    assert np.all(res["norm_resln"].values[2, :, :, short:] == 0)
    np.testing.assert_allclose(res["attention"].input(0).sum(-1), 1.0, atol=1e-5)


def _uniform_bert(n_heads: int = 2, d: int = 4) -> T.BertModel:
    """One layer, Q = K = 0 (uniform attention), W_V = W_O = I, no biases in V/O, identity LN affine."""
    cfg = T.BertConfig(
        vocab_size=20,
        hidden_size=d,
        num_hidden_layers=1,
        num_attention_heads=n_heads,
        intermediate_size=8,
        max_position_embeddings=16,
        type_vocab_size=1,
    )
    torch.manual_seed(0)
    model = T.BertModel(cfg, add_pooling_layer=False).eval()
    layer = model.encoder.layer[0]
    with torch.no_grad():
        for lin in (layer.attention.self.query, layer.attention.self.key):
            lin.weight.zero_()
            lin.bias.zero_()
        for lin in (layer.attention.self.value, layer.attention.output.dense):
            lin.weight.copy_(torch.eye(d))
            lin.bias.zero_()
    model.config._attn_implementation = "eager"
    return model


def test_known_answer_uniform_identity_model():
    model = _uniform_bert()
    lens = mixlens.Lens(model, T.AutoTokenizer.from_pretrained(mixlens.lens.default_model_path()))
    ids = torch.tensor([[3, 7, 11, 5, 2]])
    enc = mixlens.lens.Encoded(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, [["a"] * 5], [[0, 1, 2, 3, 4]], [0]
    )
    tr = lens.trace(enc)
    x = tr.layers[0].x[0].numpy().astype(np.float64)  # [n, d]
    n, d = x.shape
    bn = mixlens.methods.norms.block_norms(tr)
    # α = 1/n everywhere, f^h(x_j) = x_j restricted to head h's two coordinates.
    np.testing.assert_allclose(tr.layers[0].alpha[0].numpy(), 1 / n, atol=1e-7)
    expect_n = np.tile(np.linalg.norm(x, axis=1) / n, (n, 1))
    np.testing.assert_allclose(bn.n[0, 0].numpy(), expect_n, rtol=1e-5)
    per_head = mixlens.methods.get("norm")(tr, heads=True)[0, 0].numpy()
    np.testing.assert_allclose(per_head[1], np.tile(np.linalg.norm(x[:, 2:], axis=1) / n, (n, 1)), rtol=1e-5)
    expect_res = expect_n.copy()
    np.fill_diagonal(expect_res, (1 + 1 / n) * np.linalg.norm(x, axis=1))
    np.testing.assert_allclose(bn.n_res[0, 0].numpy(), expect_res, rtol=1e-5)
    # LayerNorm with γ = 1: g_i(v) = (v − mean v) / s_i, s_i = std of y_i = mean_j x_j + x_i.
    y = x.mean(0) + x
    s = np.sqrt(y.var(axis=1) + 1e-12)
    c = x - x.mean(1, keepdims=True)
    expect_ln = np.linalg.norm(c, axis=1)[None, :] / n / s[:, None]
    np.fill_diagonal(expect_ln, (1 + 1 / n) * np.linalg.norm(c, axis=1) / s)
    np.testing.assert_allclose(bn.n_resln[0, 0].numpy(), expect_ln, rtol=1e-4)
    # Mixing ratios: W = 1 − 1/n; N compares ‖Σ_{j≠i} x_j‖/n with ‖x_i‖/n.
    others = x.sum(0) - x
    on, self_n = np.linalg.norm(others, axis=1), np.linalg.norm(x, axis=1)
    np.testing.assert_allclose(bn.ratio["W"][0, 0].numpy(), 1 - 1 / n, rtol=1e-6)
    np.testing.assert_allclose(bn.ratio["Res-W"][0, 0].numpy(), (1 - 1 / n) / 2, rtol=1e-6)
    np.testing.assert_allclose(bn.ratio["N"][0, 0].numpy(), on / (on + self_n), rtol=1e-5)
    np.testing.assert_allclose(bn.ratio["Res-N"][0, 0].numpy(), on / (on + (n + 1) * self_n), rtol=1e-5)
    oc = np.linalg.norm(others - others.mean(1, keepdims=True), axis=1)
    sc = np.linalg.norm(c, axis=1)
    np.testing.assert_allclose(bn.ratio["ResLN-N"][0, 0].numpy(), oc / (oc + (n + 1) * sc), rtol=1e-5)


def test_mixing_ratio_is_norm_of_sum_not_sum_of_norms():
    """Two opposite contexts cancel: r_N must be 0 although each ‖α f‖ is large."""
    model = _uniform_bert(n_heads=1, d=4)
    lens = mixlens.Lens(model, T.AutoTokenizer.from_pretrained(mixlens.lens.default_model_path()))
    ids = torch.tensor([[3, 7, 7]])
    with torch.no_grad():  # make embeddings of tokens 3 and 7 (+positions) so that x_1 = −x_2
        emb = model.embeddings
        emb.LayerNorm.weight.fill_(1)
        emb.LayerNorm.bias.zero_()
        emb.position_embeddings.weight.zero_()
        emb.token_type_embeddings.weight.zero_()
        emb.word_embeddings.weight[3] = torch.tensor([1.0, 2.0, 3.0, 4.0])
        emb.word_embeddings.weight[7] = torch.tensor([4.0, -1.0, 0.5, 2.0])
        emb.position_embeddings.weight[2] = -2 * emb.word_embeddings.weight[7]  # x_2 = LN(−w7) = −x_1
    enc = mixlens.lens.Encoded(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, [["a"] * 3], [[0, 1, 2]], [0]
    )
    tr = lens.trace(enc)
    x = tr.layers[0].x[0]
    assert torch.allclose(x[1], -x[2], atol=1e-5)
    bn = mixlens.methods.norms.block_norms(tr)
    assert bn.ratio["N"][0, 0, 0].item() == pytest.approx(0.0, abs=1e-5)
    assert bn.n[0, 0, 0, 1] > 0.1 and bn.n[0, 0, 0, 2] > 0.1


def test_wrong_adapter_fails_loudly_naming_the_layer(bundled, monkeypatch):
    tr = bundled.trace(SENTENCES[:1])
    lay = bundled.adapter.layers[3]
    monkeypatch.setattr(lay, "raw_w_o", lay.raw_w_o * 1.01)
    with pytest.raises(ReconstructionError, match="layer 3"):
        mixlens.methods.norms.block_norms(tr)


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "torch"])
def test_nan_in_the_real_output_fails_the_check(bundled, compiled, monkeypatch):
    """A NaN in what the model computed is a failed reconstruction, not an error of NaN that passes."""
    monkeypatch.setattr(mixlens.methods.norms, "COMPILED", compiled)
    tr = bundled.trace(SENTENCES[:1])
    tr.layers[2].mix_out[0, 1, 5] = float("nan")
    with pytest.raises(ReconstructionError, match="layer 2.* nan"):
        mixlens.methods.norms.block_norms(tr)


def test_expansion_rate(bundled):
    rate = mixlens.stats.mixing.expansion_rate(bundled.adapter)
    assert rate.shape == (6, 12)
    lay = bundled.adapter.layers[2]
    h, dh = 5, lay.d_head
    wv = lay.w_v[:, h * dh : (h + 1) * dh]
    wo = lay.w_o[h * dh : (h + 1) * dh]
    d = wo.shape[1]
    m = torch.zeros(d + 1, d + 1)
    m[:d, :d] = wv @ wo
    m[d, :d] = lay.b_v[h * dh : (h + 1) * dh] @ wo
    m[d, d] = 1
    assert rate[2, 5].item() == pytest.approx((m.norm() / (d + 1) ** 0.5).item(), rel=1e-5)


def test_upcast_and_special_roles(tokenizer):
    model = mixlens.lens.load().model.to(torch.float64)
    with pytest.warns(UserWarning, match="fp32"):
        lens = mixlens.Lens(model, tokenizer)
    assert next(lens.model.parameters()).dtype == torch.float32
    ids = tokenizer("hello world")["input_ids"]
    assert lens.special_roles(ids) == ["cls", None, None, "sep"]


@pytest.mark.parametrize(
    "family, head",
    [
        ("bert", "AutoModelForMaskedLM"),
        ("roberta", "AutoModelForSequenceClassification"),
        ("gpt2", "AutoModelForCausalLM"),
        ("llama", "AutoModelForCausalLM"),
    ],
)
def test_any_automodel_head_finds_the_encoder(tokenizer, family, head):
    lens = random_lens(family, tokenizer, head=head)
    res = lens.analyze(SENTENCES[:2], ["norm_resln"])
    assert res.reconstruction_error.max() <= 1e-4
    assert res["norm_resln"].values.shape[1] == lens.model.config.num_hidden_layers


def test_local_directory_roundtrip_and_unsupported_family(tmp_path, tokenizer):
    model = random_model("distilbert", tokenizer)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    lens = mixlens.load(tmp_path / "m")
    assert lens.adapter.family.name == "distilbert"
    cfg = T.T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, d_kv=16)
    T.T5Model(cfg).save_pretrained(tmp_path / "t5")
    with pytest.raises(mixlens.MixlensError, match="unsupported architecture 't5'; supported model types: albert"):
        mixlens.load(tmp_path / "t5")


def test_the_engine_has_one_door():
    """Outside the engine (norms and its private modules) mixlens imports the engine only through
    `mixlens.methods.engine`."""
    import ast
    from pathlib import Path

    root = Path(mixlens.__file__).resolve().parent
    inside = {"methods/norms.py", "methods/engine.py", "methods/memo.py", "methods/__init__.py"}
    private = (
        "mixlens.methods._compiled",
        "mixlens.methods._kernels",
        "mixlens.methods._numba",
        "mixlens.methods._torch_passes",
        "mixlens.methods.norms",
    )
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel in inside or rel.startswith("methods/_"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in private:
                found.append(f"{rel}: {node.module}")
    assert not found, found


def test_engine_backend_is_a_setting(bundled):
    from mixlens.methods import engine

    tr = bundled.trace(SENTENCES[:2])
    assert engine.get_backend() == "compiled"
    with engine.backend("torch"):
        assert engine.get_backend() == "torch"
        slow = mixlens.run_methods(tr, ["norm_resln"]).values["norm_resln"]
    assert engine.get_backend() == "compiled"
    fast = mixlens.run_methods(bundled.trace(SENTENCES[:2]), ["norm_resln"]).values["norm_resln"]
    torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-6)
    with pytest.raises(mixlens.MixlensError, match="unknown engine backend 'gpu'"):
        engine.set_backend("gpu")
