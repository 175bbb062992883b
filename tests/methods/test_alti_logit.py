"""ALTI-Logit and Logit (Ferrando et al. 2023; docs/reference/global.md): exact sums on every decoder family, equality
with the authors' code (mt-upc/logit-explanations) on a random GPT-2, the carry-back, and bad input."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from mixlens.adapters import logit_scale
from mixlens.errors import MixlensError, ReconstructionError
from mixlens.explain import explain
from mixlens.methods import get as get_method
from tests.conftest import SENTENCES, random_lens, run_cli

DECODERS = ["gpt2", "llama", "gemma2", "gemma3_text", "qwen3", "phi3", "granite", "olmo2", "mixtral"]
DECODERS += ["opt", "bloom", "gpt_neox", "falcon"]
METHODS = ["alti_logit", "logit_attn"]
REF_ENV = "MIXLENS_LOGIT_EXPLANATIONS"  # a checkout of github.com/mt-upc/logit-explanations (never committed here)


@pytest.fixture(scope="module", params=DECODERS)
def lm(request, tokenizer):
    return random_lens(request.param, tokenizer, head="AutoModelForCausalLM", seed=1)


def head_logits(lens, enc) -> torch.Tensor:
    """The LM head's own output at each input's last real token [B, V] in a plain forward pass: the logits before
    Gemma 2's final soft cap and after Granite's division by logits_scaling (the scalar the methods decompose), from
    a hook on the unembedding."""
    got: list[torch.Tensor] = []
    handle = lens.model.get_output_embeddings().register_forward_hook(lambda m, a, o: got.append(o))
    try:
        with torch.no_grad():
            lens.model(**enc.inputs)
    finally:
        handle.remove()
    last = enc.inputs["attention_mask"].sum(-1) - 1
    return got[0][torch.arange(last.shape[0]), last].float() * logit_scale(lens.adapter)  # Granite: / logits_scaling


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("contrast", [False, True])
def test_scores_plus_remainder_equal_the_logit(lm, method, contrast):
    """Σ_j score_j + remainder = logit(target) (− logit(foil)) on a padded batch, checked from outside the method
    against the LM head's output; the per-layer extra sums to the scores, the MLP terms are part of the remainder."""
    enc = lm.encode(SENTENCES)
    rows = head_logits(lm, enc)
    target, foil = (5, 7) if contrast else ("pred", None)
    opts: dict[str, object] = {"target": target} if foil is None else {"target": target, "foil": foil}
    res = lm.analyze(SENTENCES, [method], options={method: opts})
    a = res[method]
    values, ex = torch.from_numpy(a.values), {k: torch.from_numpy(v) for k, v in a.extras.items()}
    want = rows[:, 5] - rows[:, 7] if contrast else rows.max(-1).values
    got = values.sum(-1) + ex["remainder"]
    err = ((got - want).abs() / rows.abs().amax(-1)).max().item()
    assert err < 1e-5, err  # the method's own check allows 1e-4; measured ≈ 1e-7
    torch.testing.assert_close(ex["layers"].sum(1), values, rtol=1e-5, atol=1e-5)
    assert ex["mlp"].shape == (len(SENTENCES), lm.adapter.n_layers)
    if method == "logit_attn":
        torch.testing.assert_close(ex["heads"].sum(2), ex["layers"], rtol=1e-5, atol=1e-6)
    lengths = enc.inputs["attention_mask"].sum(-1)
    for b, m in enumerate(lengths.tolist()):
        assert (values[b, m:] == 0).all()


def test_carry_back_keeps_each_layers_sum(lm):
    """ALTI's rows sum to 1, so each layer's carried-back row keeps the sum of its direct row; layer 0 is not carried;
    the remainder is the same."""
    res = lm.analyze(SENTENCES, METHODS, options={m: {"target": 11, "foil": 3} for m in METHODS})
    alti, direct = res["alti_logit"].extras, res["logit_attn"].extras
    np.testing.assert_allclose(alti["layers"].sum(-1), direct["layers"].sum(-1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(alti["layers"][:, 0], direct["layers"][:, 0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(alti["remainder"], direct["remainder"], rtol=1e-6, atol=1e-6)


def test_carry_back_is_the_alti_rollout(tokenizer):
    """On GPT-2 (where the `alti` method applies) layer l's row is carried through alti's own matrices,
    Δ^l C_{l−1} ⋯ C_0 — written here as explicit products of the `alti` method's output."""
    lens = random_lens("gpt2", tokenizer, head="AutoModelForCausalLM", seed=2, n_layer=3)
    res = lens.analyze(SENTENCES[:1], ["alti", "alti_logit", "logit_attn"], options={"alti_logit": {"target": 9}})
    c = torch.from_numpy(res["alti"].values[0]).double()  # [L, n, n]
    direct = torch.from_numpy(
        lens.analyze(SENTENCES[:1], ["logit_attn"], options={"logit_attn": {"target": 9}})["logit_attn"].extras[
            "layers"
        ][0]
    ).double()
    want = torch.stack([direct[0], direct[1] @ c[0], direct[2] @ c[1] @ c[0]])
    np.testing.assert_allclose(res["alti_logit"].extras["layers"][0], want.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("qk_rows", [False, True])
def test_the_check_catches_a_wrong_decomposition(tokenizer, qk_rows):
    """The per-run check is live: a value vector changed after the forward pass breaks the sum (also when α's rows
    are rebuilt from q and K, where the check runs per block of rows); so does a wrong row normaliser."""
    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM")
    tr = lens.trace(lens.encode(SENTENCES[:1]), ffn=True, qk_rows=qk_rows)
    tr.layers[1].value.mul_(1.01)
    for m in METHODS:
        with pytest.raises(ReconstructionError, match="differ"):
            get_method(m)(tr)
    if qk_rows:
        tr = lens.trace(lens.encode(SENTENCES[:1]), ffn=True, qk_rows=True)
        tr.layers[0].qk.lse.add_(0.01)  # every α row 1 % off
        with pytest.raises(ReconstructionError, match="differ"):
            get_method("alti_logit")(tr)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "bloom", "gpt_neox"])
def test_bfloat16_checks_within_its_rounding(tokenizer, family):
    """A bfloat16 model runs in bfloat16; the sums are checked to its rounding (`norms.tolerance`), and the scores
    agree with the float32 model's to that rounding."""
    import mixlens
    from tests.conftest import random_model

    lens = mixlens.Lens(random_model(family, tokenizer, "AutoModelForCausalLM", seed=1), tokenizer, dtype="bfloat16")
    ref = random_lens(family, tokenizer, head="AutoModelForCausalLM", seed=1)
    for m in METHODS:
        got = lens.analyze(SENTENCES, [m], options={m: {"target": 5, "foil": 7}})[m]
        want = ref.analyze(SENTENCES, [m], options={m: {"target": 5, "foil": 7}})[m]
        scale = max(1e-3, float(np.abs(want.values).max()))
        assert np.abs(got.values - want.values).max() <= 0.1 * scale, m


def test_target_position(tokenizer):
    """`position` explains the logit read at an earlier token: only sources up to it score."""
    lens = random_lens("gpt2", tokenizer, head="AutoModelForCausalLM")
    enc = lens.encode(SENTENCES[:1])
    with torch.no_grad():
        logits = lens.model(**enc.inputs).logits[0, 4]
    res = lens.analyze(SENTENCES[:1], ["alti_logit"], options={"alti_logit": {"position": 4, "target": 8}})
    a = res["alti_logit"]
    assert (a.values[0, 5:] == 0).all()
    assert abs(a.values[0].sum() + a.extras["remainder"][0] - logits[8].item()) < 1e-4 * logits.abs().max().item()


def test_explain_passes_target_and_foil(tokenizer):
    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM")
    e = explain(lens, SENTENCES[:1], METHODS, target=20, foil=30).inputs[0]
    rows = head_logits(lens, lens.encode(SENTENCES[:1]))
    for m in METHODS:
        direct = lens.analyze(SENTENCES[:1], [m], options={m: {"target": 20, "foil": 30}})[m]
        np.testing.assert_allclose(e.scores[m], direct.values[0], rtol=1e-6, atol=1e-7)
        total = e.scores[m].sum() + direct.extras["remainder"][0]
        assert abs(total - (rows[0, 20] - rows[0, 30]).item()) < 1e-4 * rows.abs().max().item()


def test_cli_option_and_json_extras(tokenizer, tmp_path, capsys):
    """`--option alti_logit.target=ID` / foil reach the method; the JSON carries the remainder, so the sum can be
    checked from it."""
    lens = random_lens("gpt2", tokenizer, head="AutoModelForCausalLM")
    lens.model.save_pretrained(tmp_path / "lm")
    lens.tokenizer.save_pretrained(tmp_path / "lm")
    out = tmp_path / "a.json"
    rc, _, err = run_cli(["analyze", SENTENCES[0], "--model", str(tmp_path / "lm"), "--method", "alti_logit",
                          "--option", "alti_logit.target=5", "--option", "alti_logit.foil=7",
                          "--format", "json", "--out", str(out)], capsys)  # fmt: skip
    assert rc == 0, err
    text = out.read_text()
    assert '"remainder"' in text and '"layers"' in text
    doc = json.loads(text)
    rows = head_logits(lens, lens.encode(SENTENCES[:1]))
    want = (rows[0, 5] - rows[0, 7]).item()

    def find(node):  # the alti_logit record, wherever the schema nests it
        if isinstance(node, dict):
            if "extras" in node and "remainder" in node["extras"]:
                return node
            for v in node.values():
                if (hit := find(v)) is not None:
                    return hit
        if isinstance(node, list):
            for v in node:
                if (hit := find(v)) is not None:
                    return hit
        return None

    rec = find(doc)
    assert rec is not None
    rem = rec["extras"]["remainder"]["values"]
    values = np.asarray(rec["values"], dtype=float)
    assert abs(values.sum() + float(rem) - want) < 1e-4 * rows.abs().max().item()


@pytest.mark.parametrize("method", METHODS)
def test_bad_input_one_line(tokenizer, method):
    lens = random_lens("gpt2", tokenizer, head="AutoModelForCausalLM")
    with pytest.raises(MixlensError, match="is the target itself") as e:
        lens.analyze(SENTENCES[:1], [method], options={method: {"target": 5, "foil": 5}})
    assert "\n" not in str(e.value)
    word = tokenizer.decode([5])
    assert f"the foil {word!r} (id 5)" in str(e.value)  # #45 item 24: the word, not only its id
    with pytest.raises(MixlensError, match="not a function"):
        lens.analyze(SENTENCES[:1], [method], options={method: {"target": lambda out, inputs: out.logits[:, -1, 0]}})
    encoder = random_lens("bert", tokenizer)
    with pytest.raises(MixlensError, match="does not support the bert family: .*causal decoder") as e:
        encoder.analyze(SENTENCES[:1], [method])
    assert "\n" not in str(e.value)
    base = random_lens("llama", tokenizer)  # a decoder without its LM head
    with pytest.raises(MixlensError, match="needs a causal language model") as e:
        base.analyze(SENTENCES[:1], [method])
    assert "\n" not in str(e.value)


# ---- the authors' code as the oracle -------------------------------------------------------------------------------


def _reference():
    """`src/contributions.py` of a checkout of mt-upc/logit-explanations (path in $MIXLENS_LOGIT_EXPLANATIONS), run
    as is; its config reader (pyaml_env, not a mixlens dependency) is replaced by PyYAML reading its own config."""
    root = Path(os.environ.get(REF_ENV, "")).expanduser()
    path = root / "src" / "contributions.py"
    if not os.environ.get(REF_ENV) or not path.is_file():
        pytest.skip(f"set {REF_ENV} to a checkout of github.com/mt-upc/logit-explanations to compare with it")
    yaml = pytest.importorskip("yaml")
    if "pyaml_env" not in sys.modules:
        stub = types.ModuleType("pyaml_env")
        stub.parse_config = lambda _: yaml.safe_load((root / "src" / "config.yaml").read_text())  # type: ignore
        sys.modules["pyaml_env"] = stub
    spec = importlib.util.spec_from_file_location("_logit_explanations_contributions", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ref_alti(layer_alti_data) -> torch.Tensor:
    """The repository's `utils_contributions.compute_alti` (that module imports captum, ipywidgets, matplotlib and
    the experiment scripts, so its three steps are restated here in its order): c = clip(−‖y_i − T_i(x_j)‖₁ +
    ‖y_i‖₁, 0) per layer, rows / their sum ('min_sum' with the resultant norm), then the rollout
    R_0 = C_0, R_l = C_l R_{l−1} (`compute_joint_attention`)."""
    contrib = layer_alti_data["layerwise_contributions"]
    resultant = torch.norm(layer_alti_data["attn_res_outputs"], p=1, dim=-1)
    norm = (contrib + resultant.abs()[..., None]).clip(min=0)
    norm = norm / norm.sum(-1, keepdim=True)
    joint = [norm[0]]
    for layer in range(1, norm.shape[0]):
        joint.append(norm[layer] @ joint[-1])
    return torch.stack(joint)


def _run_reference(ref, model, enc, tokens, pairwise_eps: float | None):
    """The authors' decomposition of a float64 copy of `model` (their float32 ALTI loses ≈ 1e-5 to cancellation).
    `pairwise_eps` replaces the eps of their `F.pairwise_distance` (torch's default 1e-6 is added to every component
    of y_i − T_i(x_j), docs/reference/global.md); None keeps their code as is."""
    fn = ref.F
    if pairwise_eps is not None:
        ref.F = types.SimpleNamespace(**{k: getattr(fn, k) for k in dir(fn) if not k.startswith("__")})
        ref.F.pairwise_distance = lambda a, b, p=2.0, eps=0.0, keepdim=False: fn.pairwise_distance(
            a, b, p=p, eps=pairwise_eps, keepdim=keepdim
        )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        wrapper = ref.ModelWrapper(copy.deepcopy(model).double())
        _, hidden, attentions = wrapper(dict(enc.inputs))  # the same inputs (GPT-2 embeds token_type_ids too)
        return wrapper.get_logit_contributions(hidden, attentions, tokens)
    finally:
        torch.set_default_dtype(default)
        ref.F = fn


@pytest.mark.parametrize("pairwise_eps", [0.0, None], ids=["eps0", "as-is"])
def test_equals_the_authors_code_on_gpt2(tokenizer, pairwise_eps):
    """mixlens (float32) = `ModelWrapper.get_logit_contributions` (the "aff_x_j" decomposition the paper's
    experiments use) followed by `extract_explanations.track2input_tokens` (restated: layer l's row times the
    rollout R_{l−1}), for logit(target) − logit(foil) at the last token, per layer, per head, and the remainder's
    parts. Their code as is differs only by torch's pairwise-distance eps in ALTI (≈ 8e-5 here, on a tiny model
    whose ‖y_i‖₁ ≈ 2; 1e-6 · d against ‖y_i‖₁ in the hundreds for GPT-2 itself)."""
    ref = _reference()
    lens = random_lens("gpt2", tokenizer, head="AutoModelForCausalLM", seed=4, n_layer=3)
    errs = _against_the_authors(ref, lens, pairwise_eps)
    assert all(v < 1e-4 for v in errs.values()), errs


@pytest.mark.parametrize("weights", ["init", "small"])
@pytest.mark.parametrize("family", ["opt", "bloom"])
def test_equals_the_authors_code_on_opt_and_bloom(tokenizer, family, weights):
    """The paper's own models: the same comparison on random OPT (pre-LN, learned positions) and BLOOM (ALiBi, fused
    per-head qkv) configs with non-trivial biases and norms (`tests.conftest`), 3 layers; "small" scales every
    matrix and bias by 0.1 so that the norms' ε is larger than their inputs' variance (an ε misplaced would show).
    Their pairwise-distance eps is set to 0 (the one convention that differs, as on GPT-2)."""
    ref = _reference()
    lens = random_lens(family, tokenizer, head="AutoModelForCausalLM", seed=4, num_hidden_layers=3)
    if weights == "small":
        with torch.no_grad():
            for name, p in lens.model.named_parameters():
                if p.dim() == 2 or "norm" not in name and name.endswith("bias"):
                    p.mul_(0.1)
    errs = _against_the_authors(ref, lens, 0.0)
    assert all(v < 1e-4 for v in errs.values()), errs


def _against_the_authors(ref, lens, pairwise_eps: float | None) -> dict[str, float]:
    """Relative differences of `logit_attn` (per layer, per head), `alti_logit` (per layer, summed) and the
    remainder from the authors' code on the first sentence, target 5, foil 7."""
    text, target, foil = SENTENCES[0], 5, 7
    enc = lens.encode([text])
    logit_vec, modules, alti_data = _run_reference(ref, lens.model.eval(), enc, [target, foil], pairwise_eps)
    aff = logit_vec["aff_x_j"][:, -1]  # [L, 2 tokens, source]
    ref_direct = aff[:, 0] - aff[:, 1]
    heads = logit_vec["aff_x_j_h"][:, :, -1]  # [L, H, 2, source]
    ref_heads = heads[:, :, 0] - heads[:, :, 1]
    rollout = _ref_alti(alti_data)
    ref_alti = torch.stack([ref_direct[0]] + [ref_direct[m] @ rollout[m - 1] for m in range(1, len(ref_direct))])

    def contrast(x):
        return float(x[0] - x[1])

    ref_rest = (
        contrast(modules["init_logit"])
        + contrast(modules["lnf_bias"])
        + sum(contrast(x) for x in modules["mlp_logit_layers"])
        + sum(contrast(x) for x in modules["b_o_logits_layers"])
    )

    opts = {"target": target, "foil": foil}
    res = lens.analyze([text], METHODS, options={m: opts for m in METHODS})
    direct, alti = res["logit_attn"], res["alti_logit"]
    scale = ref_direct.abs().max().item()
    errs = {
        "logit_attn layers": np.abs(direct.extras["layers"][0] - ref_direct.numpy()).max() / scale,
        "logit_attn heads": np.abs(direct.extras["heads"][0] - ref_heads.numpy()).max() / scale,
        "alti_logit layers": np.abs(alti.extras["layers"][0] - ref_alti.numpy()).max() / scale,
        "alti_logit": np.abs(alti.values[0] - ref_alti.sum(0).numpy()).max() / scale,
        "remainder": abs(float(direct.extras["remainder"][0]) - ref_rest) / max(1.0, abs(ref_rest)),
    }
    name = lens.adapter.family.name
    print(f"relative differences to mt-upc/logit-explanations ({name}, pairwise eps {pairwise_eps}):",
          {k: f"{v:.2e}" for k, v in errs.items()})  # fmt: skip
    return errs
