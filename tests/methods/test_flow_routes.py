"""Information-flow routes (Ferrando & Voita 2024): exact edge vectors, the paper's importance, τ, a graph connected
top-down from the prediction, the per-token route score, the figure and the CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mixlens.errors import MixlensError, ReconstructionError
from mixlens.methods import flow_routes as fr
from mixlens.methods.alti import alti_vectors
from mixlens.trace import repeat_kv
from tests.conftest import SENTENCES, random_lens, run_cli

CAUSAL = "AutoModelForCausalLM"


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma3_text"])
def lens(request, tokenizer):
    return random_lens(request.param, tokenizer, head=CAUSAL, initializer_range=0.2)


def _trace(lens, texts=SENTENCES):
    enc = lens.encode(texts)
    with torch.no_grad():
        return lens.trace(enc, ffn=True)


def _reference(trace, b: int, layer: int, i: int, per_head: bool = True) -> tuple[np.ndarray, float, float, float]:
    """The importances of the edges into m^l_i and x^l_i the direct way (float64), as the authors' tool defines them
    (facebookresearch/llm-transparency-tool, `routes/contributions.py`, read, not copied): the proximity
    max(ε, ‖y‖₁ − ‖y − e‖₁) of every part — per (head, source) over all m sources, a causal mask's zero vectors
    included — and of the residual, normalised over them: (attention edges [m] summed over heads, attention residual,
    FFN edge, FFN residual)."""
    lt, lay = trace.layers[layer], trace.adapter.layers[layer]
    m = int(trace.mask[b].sum())
    v = repeat_kv(lt.value, lay.n_heads)[b, :, :m].double()  # [H, m, d_h]
    w = lay.w_o.detach().double().reshape(lay.n_heads, lay.d_head, -1)
    a = lt.alpha_mix[b, :, i, :m].double()  # [H, m]
    z = torch.einsum("hj,hjk,hkd->hjd", a, v, w)  # [H, m, d]  α^h_ij f^h(x_j)
    z = z if per_head else z.sum(0, keepdim=True)
    y, x = lt.mix_in[b, i].double(), lt.x[b, i].double()

    def prox(e):
        return (y.abs().sum() - (y - e).abs().sum(-1)).clamp_min(fr.EPS)

    p, pr = prox(z), prox(x)
    att, res = p / (p.sum() + pr), pr / (p.sum() + pr)
    out, mid = lt.out[b, i].double(), lt.mix_in[b, i].double()
    f = out - mid
    qf = (out.abs().sum() - (out - f).abs().sum()).clamp_min(fr.EPS)
    qr = (out.abs().sum() - (out - mid).abs().sum()).clamp_min(fr.EPS)
    return att.sum(0).detach().numpy(), float(res), float(qf / (qf + qr)), float(qr / (qf + qr))


def _threshold(heads: np.ndarray, res: float, tau: float) -> tuple[np.ndarray, float]:
    """The tool's threshold and renormalisation (`apply_threshold_and_renormalize`) of one node's per-head `heads`
    [H, m] and residual importances, then the token edge = the sum over heads (`build_full_graph`)."""
    kept, r = heads * (heads > tau), res * (res > tau)
    total = kept.sum() + r
    return kept.sum(0) / total, r / total


@pytest.mark.parametrize("per_head", [True, False])
def test_edge_vectors_are_exact_and_importances_are_the_papers(lens, per_head):
    """Every kept node's edge vectors sum to the real residual stream (checked on every run, error reported), and
    the importances equal the tool's definition computed the direct way in float64."""
    tr = _trace(lens)
    for b in range(len(SENTENCES)):
        pos = int(tr.mask[b].sum()) - 1
        r = fr.input_routes(tr, b, pos, 1e-9, heads=False, per_head=per_head, renormalize=False)
        assert r.error < 1e-5
        n_layers = len(tr.layers)
        for layer in (n_layers - 1, 0):
            att, res, ffn, ffn_res = _reference(tr, b, layer, pos, per_head)
            if layer == n_layers - 1:  # the target's own node is always in the graph
                np.testing.assert_allclose(r.edges[layer, pos].numpy(), att, atol=2e-5)
                assert r.residual[layer, pos].item() == pytest.approx(res, abs=2e-5)
            assert r.ffn[layer, pos].item() == pytest.approx(ffn, abs=2e-5)
            assert r.ffn_residual[layer, pos].item() == pytest.approx(ffn_res, abs=2e-5)


def test_the_default_thresholds_per_head_and_renormalises_as_the_tool(lens):
    """Defaults (per-head parts, τ = 0.04, renormalised): the prediction's node gets the tool's thresholded,
    renormalised importances, token edges summed over heads; the kept edges into a node then sum to 1."""
    tr = _trace(lens, SENTENCES[:1])
    pos = int(tr.mask[0].sum()) - 1
    r = fr.input_routes(tr, 0, pos, fr.TAU, heads=False)
    h = fr.input_routes(tr, 0, pos, 1e-12, heads=True, renormalize=False)  # raw per-head importances
    top = len(tr.layers) - 1
    heads = h.edges[top, :, pos].double().numpy()
    want_edges, want_res = _threshold(heads, float(h.residual[top, pos]), fr.TAU)
    np.testing.assert_allclose(r.edges[top, pos].numpy(), want_edges, atol=1e-6)
    assert r.residual[top, pos].item() == pytest.approx(want_res, abs=1e-6)
    kept = (r.edges.sum(-1) + r.residual)[r.nodes > 0]
    np.testing.assert_allclose(kept.numpy(), 1.0, atol=1e-5)
    assert r.tokens.sum().item() == pytest.approx(1.0, abs=1e-5)  # renormalised: the routes share the prediction


def test_a_broken_decomposition_raises(tokenizer):
    lens = random_lens("gpt2", tokenizer, head=CAUSAL)
    tr = _trace(lens)
    tr.layers[1].mix_in = tr.layers[1].mix_in + 0.1  # the real node no longer equals its edges
    with pytest.raises(ReconstructionError, match="layer 1: the (FFN|attention) edge vectors differ"):
        fr.input_routes(tr, 0, int(tr.mask[0].sum()) - 1, fr.TAU, heads=False)


def test_tau_keeps_fewer_edges_as_it_grows_and_the_graph_is_connected(lens):
    tr = _trace(lens, SENTENCES[:1])
    pos = int(tr.mask[0].sum()) - 1
    previous = None
    for tau in (1e-9, 0.01, 0.04, 0.1, 0.3):
        r = fr.input_routes(tr, 0, pos, tau, heads=False, renormalize=False)
        kept = (r.edges > 0, r.residual > 0, r.ffn > 0, r.ffn_residual > 0, r.nodes > 0)
        if previous is not None:  # monotone: every edge and node kept at a larger τ is kept at a smaller one
            for now, before in zip(kept, previous, strict=True):
                assert not (now & ~before).any()
        previous = kept
        # connected top-down: the prediction is a node; every other node feeds a kept edge into the layer above
        n_layers = r.nodes.shape[0]
        assert r.nodes[-1].nonzero().flatten().tolist() == [pos]
        for layer in range(n_layers - 1):
            upper = r.edges[layer + 1]
            feeds = (upper > 0).any(0)
            feeds[r.residual[layer + 1] > 0] = True
            assert torch.equal(r.nodes[layer] > 0, feeds)
        feeds = (r.edges[0] > 0).any(0)
        feeds[r.residual[0] > 0] = True
        assert torch.equal(r.inputs > 0, feeds)
        # an attention edge only enters a node that is in the graph and kept through one of its FFN-block edges
        rows = (r.edges > 0).any(-1) | (r.residual > 0)
        assert not (rows & (r.nodes == 0)).any()
        assert not (rows & (r.ffn == 0) & (r.ffn_residual == 0)).any()
        # the tool's threshold on the head-summed edge; i → i and the residual are one edge of its graph
        eye = torch.eye(r.edges.shape[-1], dtype=torch.bool)
        assert ((r.edges == 0) | (r.edges > tau) | eye).all()
        own = r.edges.diagonal(dim1=1, dim2=2)
        merged = own + r.residual
        assert torch.equal(own > 0, merged > tau) and torch.equal(r.residual > 0, merged > tau)
    # τ → 0: every route is kept and the route scores share the whole prediction
    r = fr.input_routes(tr, 0, pos, 1e-9, heads=False, renormalize=False)
    assert r.tokens.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert fr.input_routes(tr, 0, pos, 0.04, heads=False, renormalize=False).tokens.sum().item() <= 1.0 + 1e-6


def test_per_head_edges_split_the_token_edges(tokenizer):
    """With heads=True an edge is (head, source): its vectors α^h_ij f^h(x_j) also sum exactly, and the importances
    of one node's edges and its residual sum to 1 (before the threshold)."""
    lens = random_lens("llama", tokenizer, head=CAUSAL, initializer_range=0.2)
    tr = _trace(lens, SENTENCES[:1])
    pos = int(tr.mask[0].sum()) - 1
    r = fr.input_routes(tr, 0, pos, 1e-9, heads=True, renormalize=False)
    assert r.edges.shape == (2, 4, pos + 1, pos + 1) and r.error < 1e-5
    total = r.edges[-1, :, pos].sum() + r.residual[-1, pos]
    assert total.item() == pytest.approx(1.0, abs=1e-5)
    res = lens.analyze(SENTENCES, ["flow_routes"], heads=True)
    assert res["flow_routes"].values.shape[1:3] == (2, 4)


def test_routes_relate_to_alti_by_one_factor_per_row(tokenizer):
    """Same proximity as ALTI (pre-LN: the same y and the same vectors for j ≠ i): per target row the routes'
    attention importances are ALTI's unnormalised contributions up to one factor (the normalisers differ — ALTI
    merges the residual into j = i, the routes keep it as its own edge), with ALTI's conventions (b_V in the
    values, the plain norm)."""
    lens = random_lens("gpt2", tokenizer, head=CAUSAL, initializer_range=0.2)
    tr = _trace(lens, SENTENCES[:1])
    pos = int(tr.mask[0].sum()) - 1
    r = fr.input_routes(
        tr, 0, pos, 1e-9, heads=False, per_head=False, renormalize=False, value_bias="values", distance_eps=0.0
    )
    t, y = alti_vectors(tr, len(tr.layers) - 1)
    yi = y[0, pos]
    alti_prox = (yi.abs().sum() - (yi - t[0, pos, : pos + 1]).abs().sum(-1)).clamp_min(0)
    others = torch.arange(pos) if pos else torch.arange(0)
    ratio = r.edges[-1, pos, others] / alti_prox[others]
    ok = alti_prox[others] > 1e-3
    assert ok.any()
    np.testing.assert_allclose(ratio[ok].numpy(), ratio[ok][0].item(), rtol=1e-4)


def test_registered_methods_and_position(lens):
    res = lens.analyze(SENTENCES, ["flow_routes", "flow_routes_tokens"])
    a, t = res["flow_routes"], res["flow_routes_tokens"]
    assert a.dims == ("layer", "target", "source") and t.dims == ("source",)
    np.testing.assert_allclose(a.extras["tokens"], t.values, atol=1e-6)
    np.testing.assert_array_equal(a.extras["position"], np.array(a.lengths) - 1)
    assert (a.extras["error"] < 1e-5).all()
    at = lens.analyze(SENTENCES, ["flow_routes"], options={"flow_routes": {"position": 2}})["flow_routes"]
    assert (at.extras["position"] == 2).all() and (at.extras["nodes"][:, -1].sum(-1) == 1).all()
    assert (at.extras["tokens"][:, 3:] == 0).all()  # a causal prediction at 2 reads tokens 0..2 only


def test_the_trace_keeps_only_the_ffn_output_and_equals_the_activation_path(lens):
    """The routes' trace captures F^l (`ffn="update"`, [n, d] per layer), not the FFN activations ([n, d_ff] ×3);
    routes from either capture are the same, and the decomposition (with flow_routes_tokens: no edge tensor) agrees."""
    from mixlens.pipeline import trace_flags

    assert trace_flags(["flow_routes"]) == ("update", True)
    assert trace_flags(["flow_routes", "decompx_logit"])[0] is True  # activations when another method needs them
    enc = lens.encode(SENTENCES)
    routes_only, with_head = lens.trace_for(enc, ["flow_routes"]), lens.trace_for(enc, ["flow_routes", "alti_logit"])
    assert routes_only.logits is None and routes_only.hidden is not None  # the head is not run: no [B, n, V] logits
    assert with_head.logits is not None and with_head.logits.shape[:2] == enc.inputs["input_ids"].shape
    with torch.no_grad():
        small, full = lens.trace(enc, ffn="update"), lens.trace(enc, ffn=True)
    lt = small.layers[0]
    assert lt.ffn_act is None and lt.ffn_pre is None and lt.ffn_update is not None
    assert lt.ffn_update.shape == lt.x.shape
    for b in range(len(SENTENCES)):
        pos = int(small.mask[b].sum()) - 1
        a = fr.input_routes(small, b, pos, fr.TAU, heads=False)
        c = fr.input_routes(full, b, pos, fr.TAU, heads=False)
        walk = fr.input_routes(small, b, pos, fr.TAU, heads=False, edges=False)
        assert a.edges is not None and c.edges is not None and walk.edges is None
        torch.testing.assert_close(a.edges, c.edges, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(a.tokens, walk.tokens)
        torch.testing.assert_close(a.ffn, c.ffn, atol=1e-6, rtol=1e-5)


def test_bad_tau_is_one_line(tokenizer):
    lens = random_lens("gpt2", tokenizer, head=CAUSAL)
    for tau in (0.0, 1.0):
        with pytest.raises(MixlensError, match=r"flow_routes.tau must be a number in \(0, 1\)") as e:
            lens.analyze(SENTENCES[:1], ["flow_routes"], options={"flow_routes": {"tau": tau}})
        assert "\n" not in str(e.value)
    with pytest.raises(MixlensError, match=r"flow_routes_tokens.tau must be a number in"):
        lens.analyze(SENTENCES[:1], ["flow_routes_tokens"], options={"flow_routes_tokens": {"tau": 1.0}})
    with pytest.raises(MixlensError, match=r"flow_routes.tau must be a number in \(0, 1\)"):
        lens.analyze(SENTENCES[:1], ["flow_routes"], options={"flow_routes": {"tau": -0.5}})


@pytest.mark.parametrize("tau", ["0", "1", "1.0"])
def test_tau_0_or_1_is_refused_before_the_model_loads(tau, capsys, monkeypatch):
    """#45 item 24: τ = 0 or 1 was refused only after the model had loaded (the registry allowed [0, 1])."""
    import mixlens.lens

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(mixlens.lens, "load", no_model)
    argv = ["analyze", "A text.", "--method", "flow_routes", "--option", f"flow_routes.tau={tau}"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "flow_routes.tau must be a number in (0, 1)" in err and len(err.splitlines()) == 1, err


def test_encoders_are_refused_in_one_line(tokenizer):
    lens = random_lens("bert", tokenizer)
    with pytest.raises(MixlensError, match="does not support the bert family: information-flow routes follow a pre-LN"):
        lens.analyze(SENTENCES[:1], ["flow_routes"])


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory, tokenizer):
    from tests.conftest import random_model

    folder = tmp_path_factory.mktemp("rgpt2")
    random_model("gpt2", tokenizer, head=CAUSAL, initializer_range=0.2).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_figure_and_report(saved_gpt2, tmp_path, capsys):
    for name in ("routes.png", "routes.svg"):
        code, _, err = run_cli(
            ["plot", SENTENCES[0], "--model", str(saved_gpt2), "--view", "routes", "-o", str(tmp_path / name)],
            capsys,
        )
        assert code == 0, err
        assert (tmp_path / name).stat().st_size > 1000
    assert (tmp_path / "routes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "r.html"
    code, _, err = run_cli(
        ["report", *SENTENCES[:2], "--model", str(saved_gpt2), "--method", "flow_routes", "-o", str(out)], capsys
    )
    assert code == 0, err
    page = out.read_text()
    assert page.count('src="data:image/png;base64,') == 2 and "Information-flow routes" in page


def test_saved_analysis_round_trips_and_plots_from_file(saved_gpt2, tmp_path, capsys):
    import mixlens
    from mixlens.result import Analysis

    lens = mixlens.load(str(saved_gpt2))
    res = lens.analyze(SENTENCES[:2], ["flow_routes"], options={"flow_routes": {"tau": 0.02}})
    res.save(tmp_path / "a")
    back = Analysis.load(tmp_path / "a")
    for k, v in res["flow_routes"].extras.items():
        np.testing.assert_array_equal(back["flow_routes"].extras[k], v)
    code, _, err = run_cli(
        ["plot", "--from", str(tmp_path / "a"), "--view", "routes", "-o", str(tmp_path / "f.png")], capsys
    )
    assert code == 0, err


def test_bad_tau_on_the_cli_exits_2(saved_gpt2, tmp_path, capsys):
    for tau in ("0", "1", "1.5", "x"):
        code, _, err = run_cli(
            ["plot", "hi there", "--model", str(saved_gpt2), "--view", "routes", "-o", str(tmp_path / "f.png")]
            + ["--option", f"flow_routes.tau={tau}"],
            capsys,
        )
        assert code == 2 and "flow_routes.tau must be a number" in err and len(err.strip().splitlines()) == 1


TOOL_ENV = "MIXLENS_LLM_TT"  # a folder with llm_transparency_tool/routes/contributions.py and deps/ (never committed)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_equals_the_authors_tool(family, tokenizer, monkeypatch):
    """The authors' tool (facebookresearch/llm-transparency-tool, `routes/contributions.py`, run unchanged as the
    oracle when MIXLENS_LLM_TT names a folder holding it and its dependencies einops, jaxtyping and typeguard under
    deps/): its contributions of the prediction's attention and FFN blocks, thresholded and renormalised at τ = 0.04,
    equal mixlens's default routes."""
    import importlib.util
    import os
    import sys

    root = os.environ.get(TOOL_ENV)
    if not root:
        pytest.skip(f"set {TOOL_ENV} to a folder with the authors' routes/contributions.py (and deps/) to compare")
    monkeypatch.setattr(sys, "path", [*sys.path, str(Path(root) / "deps")])
    spec = importlib.util.spec_from_file_location(
        "lltt_contributions", Path(root) / "llm_transparency_tool" / "routes" / "contributions.py"
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, tool)  # typeguard reads the module's source through sys.modules
    spec.loader.exec_module(tool)
    lens = random_lens(family, tokenizer, head=CAUSAL, initializer_range=0.2)
    tr = _trace(lens, SENTENCES[:1])
    m = int(tr.mask[0].sum())
    pos, top = m - 1, len(tr.layers) - 1
    r = fr.input_routes(tr, 0, pos, fr.TAU, heads=False)
    for layer in (top,):
        lt, lay = tr.layers[layer], tr.adapter.layers[layer]
        value = lt.value.float()
        if lay.b_v is not None:  # the tool folds b_V into b_O (TransformerLens's fold_value_biases)
            value = value - lay.b_v.float().view(lay.n_kv_heads, lay.d_head)[None, :, None]
        v = repeat_kv(value, lay.n_heads)[0, :, :m]
        w = lay.w_o.detach().float().reshape(lay.n_heads, lay.d_head, -1)
        a = lt.alpha_mix[0, :, pos, :m].float()
        parts = torch.einsum("hj,hjk,hkd->jhd", a, v, w)  # [key_pos, head, d]
        c_attn, c_res = tool.get_attention_contributions(
            resid_pre=lt.x[0:1, pos : pos + 1].float(),
            resid_mid=lt.mix_in[0:1, pos : pos + 1].float(),
            decomposed_attn=parts[None, None],
        )
        c_attn, c_res = tool.apply_threshold_and_renormalize(fr.TAU, c_attn, c_res)
        torch.testing.assert_close(r.edges[layer, pos], c_attn[0, 0].sum(-1), atol=1e-5, rtol=1e-4)
        assert r.residual[layer, pos].item() == pytest.approx(c_res[0, 0].item(), abs=1e-5)
        mid, out = lt.mix_in[0:1, pos : pos + 1].float(), lt.out[0:1, pos : pos + 1].float()
        c_ffn, c_ffn_res = tool.get_mlp_contributions(resid_mid=mid, resid_post=out, mlp_out=out - mid)
        c_ffn, c_ffn_res = tool.apply_threshold_and_renormalize(fr.TAU, c_ffn, c_ffn_res)
        assert r.ffn[layer, pos].item() == pytest.approx(c_ffn[0, 0].item(), abs=1e-5)
        assert r.ffn_residual[layer, pos].item() == pytest.approx(c_ffn_res[0, 0].item(), abs=1e-5)


TOOL_DATA = Path(__file__).resolve().parents[1] / "data" / "flow_routes_tool.json"


def _tool_edges(r: fr.Routes, n_layers: int) -> dict[tuple[str, str], float]:
    """mixlens's routes as the tool's graph (`routes/graph.py` node names: X0_j embedding, A{l}_i after attention,
    M{l}_i the FFN, I{l}_i layer output), the edge i → i and the residual merged into one edge as the tool does."""
    out: dict[tuple[str, str], float] = {}
    assert r.edges is not None
    for layer in range(n_layers):
        for i in range(len(r.tokens)):
            a, mid = f"A{layer}_{i}", f"M{layer}_{i}"
            if r.ffn[layer, i] > 0:
                out[a, mid] = out[mid, f"I{layer}_{i}"] = float(r.ffn[layer, i])
            if r.ffn_residual[layer, i] > 0:
                out[a, f"I{layer}_{i}"] = float(r.ffn_residual[layer, i])
            for j in range(len(r.tokens)):
                w = float(r.edges[layer, i, j]) + (float(r.residual[layer, i]) if i == j else 0.0)
                if w > 0:
                    out[f"X0_{j}" if layer == 0 else f"I{layer - 1}_{j}", a] = w
    return out


def _tool_trace(lens, ids: list[int]):
    enc = lens.encode_ids([ids])
    enc.inputs.pop("token_type_ids", None)  # the bundled (BERT) tokenizer's; GPT-2 would add wte[0] for them
    with torch.no_grad():
        return lens.trace(enc, ffn="update")


def test_equals_the_authors_tool_end_to_end(tokenizer):
    """The authors' tool run whole (transformer_lens model, `build_full_graph`, `build_paths_to_predictions`; values
    stored in tests/data/flow_routes_tool.json, its `note` says how they were produced) on a GPT-2 with non-zero
    biases (b_V too) and a small residual stream: mixlens's defaults give the tool's raw shares of every node and its
    pruned graphs (τ 0.04 and 0.1, two positions, renormalised or not) to 1e-5."""
    import json

    import mixlens
    from tests.methods.tool_gpt2 import tool_gpt2

    want = json.loads(TOOL_DATA.read_text(encoding="utf-8"))
    lens = mixlens.Lens(tool_gpt2(), tokenizer, name="tool-gpt2")
    tr = _tool_trace(lens, want["ids"])
    n_layers, n = len(tr.layers), len(want["ids"])
    worst = 0.0
    for p in range(n):  # from x^{L-1}_p with τ below the floor ε every node under it is kept: its raw shares
        raw = fr.input_routes(tr, 0, p, 1e-12, heads=True, renormalize=False)
        assert raw.edges is not None
        for layer, w in enumerate(want["raw"]):
            rows = [p] if layer == n_layers - 1 else list(range(n))  # the top layer: the prediction's node alone
            for got, key in (
                (raw.edges[layer].transpose(0, 1), "attention"),  # [target, H, source]
                (raw.residual[layer], "residual"),
                (raw.ffn[layer], "ffn"),
                (raw.ffn_residual[layer], "ffn_residual"),
            ):
                ref = torch.tensor(w[key])  # attention [H, target, source]: every source, as the tool
                ref = ref.transpose(0, 1) if key == "attention" else ref
                worst = max(worst, float((got[rows] - ref[rows]).abs().max()))
    assert worst < 1e-5
    for g in want["graphs"]:
        tau = g["tau"]
        r = fr.input_routes(tr, 0, g["position"], tau, heads=False, renormalize=g["renormalize"])
        got = _tool_edges(r, n_layers)
        ref = {(u, v): w for u, v, w in g["edges"]}
        assert set(got) == set(ref), (tau, g["position"], g["renormalize"])  # the same pruned graph
        if g["renormalize"]:  # the tool's FFN normaliser: its residual plus the kept FFN shares of ALL positions
            for layer, w in enumerate(want["raw"]):  # (`sum(dim=())` in apply_threshold_and_renormalize sums all)
                c_ffn, c_res = torch.tensor(w["ffn"]), torch.tensor(w["ffn_residual"])
                c_ffn, c_res = c_ffn * (c_ffn > tau), c_res * (c_res > tau)
                tool_denom, own_denom = c_res + c_ffn.sum(), c_res + c_ffn
                for i in range(n):
                    for e in ((f"A{layer}_{i}", f"M{layer}_{i}"), (f"M{layer}_{i}", f"I{layer}_{i}")):
                        if e in ref:  # mixlens: the kept FFN-block edges into x^l_i sum to 1
                            ref[e] = ref[e] * float(tool_denom[i] / own_denom[i])
                    e = (f"A{layer}_{i}", f"I{layer}_{i}")
                    if e in ref:
                        ref[e] = ref[e] * float(tool_denom[i] / own_denom[i])
        assert max(abs(got[e] - ref[e]) for e in ref) < 1e-5


def test_the_papers_conventions_differ_from_the_tool_on_small_activations(tokenizer):
    """On the same model, b_V given to the sources and the plain norm (no δ) move the shares past 1e-5: the
    conventions are not cosmetic (and the test above can fail)."""
    import json

    import mixlens
    from tests.methods.tool_gpt2 import tool_gpt2

    want = json.loads(TOOL_DATA.read_text(encoding="utf-8"))
    lens = mixlens.Lens(tool_gpt2(), tokenizer, name="tool-gpt2")
    tr = _tool_trace(lens, want["ids"])
    n = len(want["ids"])
    ref = torch.tensor(want["raw"][-1]["attention"])
    for kw in ({"value_bias": "values"}, {"distance_eps": 0.0}):
        r = fr.input_routes(tr, 0, n - 1, 1e-12, heads=True, renormalize=False, **kw)
        assert r.edges is not None and float((r.edges[-1] - ref).abs().max()) > 1e-5
