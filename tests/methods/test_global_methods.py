"""Whole-layer and global methods: rollout, attention flow, GlobEnc, ALTI, value zeroing.

Exactness (decomposed vectors + bias terms rebuild the real norm outputs) on every family, row sums,
batched == unbatched, known answers on a hand-built model, and bad input through the real CLI.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mixlens
from mixlens.adapters import get_path
from mixlens.cli import main
from mixlens.methods import alti as alti_mod
from mixlens.methods.alti import alti_vectors
from mixlens.methods.globenc import globenc_vectors
from mixlens.methods.memo import Memo
from mixlens.methods.norms import block_norms
from mixlens.methods.registry import refused_by
from mixlens.methods.rollout import FLOW_MAX_TOKENS, in_range, rollout
from tests.conftest import SENTENCES, random_lens

ROW_STOCHASTIC = [
    "attention_rollout",
    "attention_flow",
    "alti",
    "alti_rollout",
    "value_zeroing",
    "value_zeroing_rollout",
    "globenc_rollout",
]
ALL = ROW_STOCHASTIC + ["globenc"]
OPTIONS = {"globenc_rollout": {"normalize": True}}


def real_mask(lengths: list[int], n: int) -> np.ndarray:
    return np.arange(n)[None, :] < np.array(lengths)[:, None]  # [B, n]


def test_rows_sum_to_one_padding_zero_and_batched_equals_unbatched(family_lens):
    refused = refused_by(family_lens.adapter.family)  # tested in test_real_models.py
    names = [m for m in ALL if m not in refused]
    options = {k: v for k, v in OPTIONS.items() if k in names}
    batched = family_lens.analyze(SENTENCES, names, batch_size=3, options=options)
    single = family_lens.analyze(SENTENCES, names, batch_size=1, options=options)
    lengths = [len(t) for t in batched.tokens]
    assert len(set(lengths)) > 1  # the batch really is padded
    m = real_mask(lengths, max(lengths))
    for name in names:
        v = batched[name].values  # [B, L, n, n]
        assert v.shape == (3, family_lens.adapter.n_layers, max(lengths), max(lengths))
        pad = ~(m[:, None, :, None] & m[:, None, None, :])
        assert np.abs(v * pad).max() == 0, name
        assert np.isfinite(v).all() and (v >= 0).all(), name
        np.testing.assert_allclose(v, single[name].values, atol=1e-5, rtol=1e-4, err_msg=name)
        if name in ROW_STOCHASTIC:
            rows = v.sum(-1)  # [B, L, n]
            np.testing.assert_allclose(
                rows, np.broadcast_to(m[:, None, :], rows.shape).astype(float), atol=1e-5, err_msg=name
            )
    if family_lens.adapter.family.causal:  # nothing flows from later tokens
        for name in names:
            assert np.abs(np.triu(batched[name].values, k=1)).max() < 1e-6, name


def test_alti_and_globenc_vectors_rebuild_the_real_outputs(family_lens):
    if "alti" in refused_by(family_lens.adapter.family):
        pytest.skip("ALTI and GlobEnc refuse this family (tested in test_real_models.py)")
    tr = family_lens.trace(SENTENCES, ffn=True)
    mask = tr.mask[:, :, None].float()
    bias = block_norms(tr).bias  # [B, L, n, d] g_i(b_O) + β (post-LN)
    res = family_lens.analyze(SENTENCES, ["alti", "globenc"])
    pre_ln = family_lens.adapter.family.pre_ln
    for layer, (lt, lay) in enumerate(zip(tr.layers, tr.adapter.layers, strict=True)):
        t, y = alti_vectors(tr, layer)  # [B, n, n, d], [B, n, d]
        if pre_ln:  # no norm on the residual path: y = real x + attention output, bias = b_O
            b_o = lay.b_o.float() if lay.b_o is not None else 0.0
            rebuilt, real = t.sum(2) + b_o, lt.mix_in.float()
        else:
            rebuilt, real = t.sum(2) + bias[:, layer], lt.mix_out.float()
        assert torch.equal(y, real)
        assert ((rebuilt - real).abs() * mask).max() < 1e-4, layer
        # ALTI from the full vectors by the L1 rule == the chunked method
        c = (y.abs().sum(-1)[:, :, None] - (y[:, :, None] - t).abs().sum(-1)).clamp_min(0)
        c = c * (tr.mask[:, :, None] & tr.mask[:, None, :])
        c = c / c.sum(-1, keepdim=True).clamp_min(1e-30)
        np.testing.assert_allclose(res["alti"].values[:, layer], c.numpy(), atol=1e-5)
        if pre_ln:  # GlobEnc on a pre-LN layer is ‖t_ij‖
            np.testing.assert_allclose(
                res["globenc"].values[:, layer],
                (t.norm(dim=-1) * (tr.mask[:, :, None] & tr.mask[:, None, :])).numpy(),
                atol=1e-4,
                rtol=1e-4,
            )
            continue
        v, rest = globenc_vectors(tr, layer)
        assert ((v.sum(2) + rest - lt.out.float()).abs() * mask).max() < 1e-4, layer
        pair = tr.mask[:, :, None] & tr.mask[:, None, :]
        np.testing.assert_allclose(
            res["globenc"].values[:, layer], (v.norm(dim=-1) * pair).numpy(), atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize("family", ["bert", "gpt2"])  # a causal model's rows skip the sources after the target
def test_alti_blocking_and_the_torch_path_match(family, tokenizer, monkeypatch):
    """The compiled sign split in blocks of 1 row and in matmul chunks of 1 row, and the torch path in chunks of 1 row
    and of many, equal the compiled default (itself checked against the explicit vectors above)."""
    import mixlens.methods.norms as norms

    tr = random_lens(family, tokenizer).trace(SENTENCES)
    whole = alti_mod.alti(tr)
    for compiled, attr in (
        (True, "ROW_BLOCK"),
        (True, "SPLIT_CHUNK_ELEMENTS"),
        (False, "ROW_CHUNK_ELEMENTS"),
        (False, None),
    ):
        with monkeypatch.context() as mp:
            mp.setattr(norms, "COMPILED", compiled)
            if attr:
                mp.setattr(alti_mod, attr, 1)  # one target row per block / chunk
            tr.memo = Memo()
            torch.testing.assert_close(alti_mod.alti(tr), whole, atol=1e-6, rtol=1e-5)


# ---- known answers on a hand-built BERT: uniform attention, W_V = W_O = I, no FFN, plain LayerNorms ----


def uniform_lens(tokenizer, n_layers: int) -> mixlens.Lens:
    """Every layer: y_i = x_i + mean_j x_j (real tokens j), then LN1, FFN = 0, LN2 (γ = 1, β = 0)."""
    lens = random_lens(
        "bert", tokenizer, hidden_size=8, num_attention_heads=2, intermediate_size=16, num_hidden_layers=n_layers
    )
    with torch.no_grad():
        for layer in lens.model.encoder.layer:
            att = layer.attention
            for lin in (att.self.query, att.self.key, layer.intermediate.dense, layer.output.dense):
                lin.weight.zero_()
                lin.bias.zero_()
            for lin in (att.self.value, att.output.dense):
                lin.weight.copy_(torch.eye(8))
                lin.bias.zero_()
            for ln in (att.output.LayerNorm, layer.output.LayerNorm):
                ln.weight.fill_(1.0)
                ln.bias.zero_()
    return lens


def centred(v: np.ndarray) -> np.ndarray:
    return v - v.mean(-1, keepdims=True)


def test_value_zeroing_known_answer(tokenizer):
    lens = uniform_lens(tokenizer, 1)
    texts = SENTENCES[:2]
    tr = lens.trace(texts)
    got = lens.analyze(texts, ["value_zeroing"])["value_zeroing"].values[:, 0]
    for b, n in enumerate(tr.lengths):
        x = tr.layers[0].x[b, :n].double().numpy()
        y = x + x.mean(0)
        # LN2(LN1(v)) ∝ C(v), so the cosine distance is that of the centred pre-norm sums
        yz = y[:, None, :] - x[None, :, :] / n  # [i, j, d]: value of j zeroed
        a, c = centred(yz), centred(y)[:, None, :]
        dist = 1 - (a * c).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(c, axis=-1))
        expect = dist / dist.sum(-1, keepdims=True)
        np.testing.assert_allclose(got[b, :n, :n], expect, atol=1e-4)
        assert np.abs(got[b, n:]).max(initial=0) == 0


def test_globenc_and_alti_known_answer(tokenizer):
    lens = uniform_lens(tokenizer, 1)
    tr = lens.trace(SENTENCES[:1])
    res = lens.analyze(SENTENCES[:1], ["globenc", "alti"])
    n, eps = tr.lengths[0], 1e-12
    x = tr.layers[0].x[0, :n].double().numpy()
    y = x + x.mean(0)
    t = np.eye(n)[:, :, None] * x[:, None, :] + x[None, :, :] / n  # t_ij
    s1 = np.sqrt(centred(y).var(-1) + eps)
    s2 = np.sqrt((centred(y) / s1[:, None]).var(-1) + eps)
    glob = np.linalg.norm(centred(t), axis=-1) / (s1 * s2)[:, None]
    np.testing.assert_allclose(res["globenc"].values[0, 0, :n, :n], glob, rtol=1e-4)
    ln1 = centred(y) / s1[:, None]
    tv = centred(t) / s1[:, None, None]
    c = np.maximum(0, np.abs(ln1).sum(-1)[:, None] - np.abs(ln1[:, None] - tv).sum(-1))
    np.testing.assert_allclose(res["alti"].values[0, 0, :n, :n], c / c.sum(-1, keepdims=True), atol=1e-5)


def test_rollout_and_flow_known_answer(tokenizer):
    """Uniform attention: Â = ½I + ½J/n, so Â^l = 2^-l I + (1 − 2^-l) J/n; one layer of flow is Â itself."""
    lens = uniform_lens(tokenizer, 2)
    res = lens.analyze(["Short one."], ["attention_rollout", "attention_flow"])
    n = len(res.tokens[0])
    eye, j = np.eye(n), np.full((n, n), 1 / n)
    for layer in range(2):
        q = 0.5 ** (layer + 1)
        np.testing.assert_allclose(res["attention_rollout"].values[0, layer], q * eye + (1 - q) * j, atol=1e-6)
    np.testing.assert_allclose(res["attention_flow"].values[0, 0], 0.5 * eye + 0.5 * j, atol=1e-5)
    np.testing.assert_allclose(res["attention_flow"].values[0, 1].sum(-1), 1, atol=1e-6)


def test_rollout_product_by_hand():
    a = torch.tensor([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [1.0, 0.0]]])[None]  # [1, L=2, 2, 2]
    out = rollout(a)
    torch.testing.assert_close(out[0, 1], torch.tensor([[0.5, 0.5], [1.0, 0.0]]))
    raw = rollout(2 * a)  # no normalisation by default: scale compounds
    torch.testing.assert_close(raw[0, 1], 4 * out[0, 1])
    torch.testing.assert_close(rollout(2 * a, normalize=True), out)


def test_attention_flow_rows_sum_to_one(bundled):
    res = bundled.analyze(["Short one.", "The cat sat."], ["attention_flow"])
    v = res["attention_flow"].values
    m = real_mask([len(t) for t in res.tokens], v.shape[-1])
    np.testing.assert_allclose(v.sum(-1), np.broadcast_to(m[:, None], v.shape[:3]).astype(float), atol=1e-5)


# ---- bad input through the real CLI: one line, exit code 2 ----


def cli(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["analyze", " ".join(["word"] * FLOW_MAX_TOKENS), "--method", "attention_flow"], "limited to 32 tokens"),
        (
            ["analyze", "A text.", "--method", "globenc_rollout", "--option", "globenc_rollout.normalize=maybe"],
            "must be true or false",
        ),
        (["analyze", "A text.", "--method", "alti", "--option", "alti.normalize=true"], "has no option"),
    ],
)
def test_cli_errors(args, message, capsys):
    code, err = cli(args, capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_cli_runs_global_methods(tmp_path, capsys):
    out = tmp_path / "a.json"
    code, err = cli(
        [
            "analyze",
            "Short one.",
            "--method",
            "globenc_rollout",
            "--method",
            "value_zeroing",
            "--option",
            "globenc_rollout.normalize=true",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    import json

    data = json.loads(out.read_text())
    m = data["inputs"][0]["methods"]
    np.testing.assert_allclose(np.array(m["globenc_rollout"]["values"]).sum(-1), 1, atol=1e-5)
    assert m["value_zeroing"]["dims"] == ["layer", "target", "source"]


def test_unnormalised_rollout_stays_finite_and_proportional() -> None:
    """30 layers whose maps grow each row ~40× (deep pre-LN norm maps): float32 products overflow; ours are the
    float64 product up to one positive factor per input and layer (full) or per row (rows)."""
    g = torch.Generator().manual_seed(0)
    mats = torch.rand(2, 30, 5, 5, generator=g) * 20
    exact = [mats[:, 0].double()]
    for layer in range(1, 30):
        exact.append(mats[:, layer].double() @ exact[-1])
    assert not torch.isfinite(exact[-1].float()).all()  # the plain float32 product would overflow
    got = rollout(mats)
    assert torch.isfinite(got).all()
    for layer in (0, 10, 29):
        ratio = got[:, layer].double() / exact[layer]
        assert torch.allclose(ratio, ratio.flatten(1)[:, :1, None], rtol=1e-4)  # one factor per input


def test_in_range_leaves_small_values_alone() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0e30, 1.0e30]])
    out = in_range(x, (1,))
    assert torch.equal(out[0], x[0])
    assert out[1].max() <= 1 and torch.allclose(out[1, 1] / out[1, 0], torch.tensor(1 / 3))


def test_in_range_lifts_underflowing_products() -> None:
    """#32.5: norm_res_rollout reached 8.1e-41 (a denormal) on a 30-layer decoder."""
    x = torch.tensor([[1.0e-30, 4.0e-31], [0.0, 0.0], [0.5, 0.25]])
    out = in_range(x, (1,))
    assert 0.5 <= out[0].max() <= 1 and torch.allclose(out[0, 1] / out[0, 0], torch.tensor(0.4))
    assert torch.equal(out[1:], x[1:])  # zeros and values in range unchanged


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_unnormalised_rollouts_stay_in_range_on_a_deep_model(family, tokenizer) -> None:
    """#32.5: over 30 layers the plain products reached 1.1e+18 and 8.1e-41; they stay finite and normal, each
    layer the plain product up to one positive factor (checked against float64), and the tables show rows to 1."""
    from mixlens.methods.norms import block_norms
    from mixlens.methods.rollout import display_rows
    from tests.conftest import random_lens

    kw = {"n_layer": 30} if family == "gpt2" else {"num_hidden_layers": 30}
    lens = random_lens(family, tokenizer, **kw)
    names = ["norm_rollout", "norm_res_rollout", "norm_resln_rollout", "globenc_rollout"]
    res = lens.analyze(["The keys to the cabinet are on the table near the door."], methods=names)
    tr = lens.trace(["The keys to the cabinet are on the table near the door."])
    mats = block_norms(tr).n_res[0].double()
    exact = [mats[0]]
    for layer in range(1, mats.shape[0]):
        exact.append(mats[layer] @ exact[-1])
    got = torch.as_tensor(res["norm_res_rollout"].input(0)).double()
    for layer in (0, 15, 29):
        nz = exact[layer] > 0  # decoders: no flow from later tokens
        ratio = got[layer][nz] / exact[layer][nz]
        assert torch.allclose(ratio, ratio[:1], rtol=1e-3)  # one factor per layer
    for m in names:
        v = torch.as_tensor(res[m].input(0))
        assert torch.isfinite(v).all() and (v >= 0).all(), m
        top = v.flatten(1).amax(1)
        assert ((top >= 2.0**-65) & (top <= 2.0**65)).all(), (m, top)  # never denormal, never 1e+38
        shown, scaled = display_rows(m, v[-1].numpy())
        assert scaled and np.allclose(shown.sum(-1), 1, atol=1e-5), m


@pytest.mark.parametrize(
    ("family", "head"), [("gpt2", "AutoModelForCausalLM"), ("bert", "AutoModelForSequenceClassification")]
)
def test_value_zeroing_logit_is_the_drop_of_the_explained_scalar(family, head, tokenizer):
    """value_zeroing_logit[j] = g(x) − g(x with v_j = 0 in every layer), g the target logit minus the foil's,
    checked against a direct run with the edit points for one source (#30 item 4)."""
    from mixlens.trace import hooked

    lens = random_lens(family, tokenizer, head=head, **({"num_labels": 3} if "Sequence" in head else {}))
    enc = lens.encode(SENTENCES[:2])
    target, foil = (2, 0) if "Sequence" in head else (11, 7)
    got = lens.analyze(
        SENTENCES[:2], ["value_zeroing_logit"], options={"value_zeroing_logit": {"target": target, "foil": foil}}
    )["value_zeroing_logit"]

    def g(edits):
        with torch.no_grad(), hooked(lens.adapter, edits):
            out = lens.model(**enc.inputs)
        logits = out.logits
        if logits.dim() == 3:
            last = enc.inputs["attention_mask"].sum(-1) - 1
            logits = logits[torch.arange(2), last]
        return logits[:, target] - logits[:, foil]

    base = g({})
    j = 2
    keep = torch.ones(enc.inputs["input_ids"].shape[1])
    keep[j] = 0
    edits = {
        f"blocks.{layer}.attn.v": (lambda v: v * keep[None, None, :, None]) for layer in range(lens.adapter.n_layers)
    }
    want = base - g(edits)
    for b in range(2):
        assert got.input(b)[j] == pytest.approx(float(want[b]), rel=1e-4, abs=1e-5)
        assert np.isfinite(got.input(b)).all()


@pytest.mark.parametrize("family", ["mpnet", "bert", "gpt2"])
def test_value_zeroing_deep_model_equals_the_whole_forward_with_v_j_zeroed(family, tokenizer):
    """Value zeroing on a 6-layer model (layer l runs alone after l skipped ones; MPNet's layers return tuples)
    equals its definition through the whole, unedited forward pass: the output of layer l with the value of token j
    zeroed in layer l only, cosine distance to the real output, clamped at 0 and rows normalised."""
    n_layers = 6
    lens = random_lens(family, tokenizer, num_hidden_layers=n_layers)
    texts = SENTENCES[:2]
    got = lens.analyze(texts, ["value_zeroing"])["value_zeroing"].values  # [B, L, n, n]
    tr = lens.trace(texts)
    layers = tr.adapter.layers
    assert len(layers) == n_layers

    def layer_outputs(ids: dict, layer: int, j: int | None) -> torch.Tensor:
        """Output of `layer` [n, d] in a whole forward pass, the value of token j zeroed in that layer."""
        seen = []

        def zero_j(mod, args, out):
            out = out.clone()
            d = out.shape[-1] // 3 if family == "gpt2" else 0  # GPT-2's fused qkv: the value is the last third
            out[:, j, 2 * d :] = 0
            return out

        hooks = [
            layers[layer].module.register_forward_hook(lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o))
        ]
        if j is not None:
            hooks.append(get_path(layers[layer].module, tr.adapter.family.v_proj).register_forward_hook(zero_j))
        try:
            with torch.no_grad():
                lens.model(**ids)
        finally:
            for h in hooks:
                h.remove()
        return seen[0][0].double()

    for b, n in enumerate(tr.lengths):
        ids = {k: v[b : b + 1, :n] for k, v in tr.inputs.items()}
        for layer in range(n_layers):
            real = layer_outputs(ids, layer, None)
            expect = np.zeros((n, n))
            for j in range(n):
                zeroed = layer_outputs(ids, layer, j)
                expect[:, j] = 1 - torch.nn.functional.cosine_similarity(zeroed, real, dim=-1).numpy()
            expect = np.clip(expect, 0, None)
            expect /= expect.sum(-1, keepdims=True)
            np.testing.assert_allclose(got[b, layer, :n, :n], expect, atol=2e-4)
