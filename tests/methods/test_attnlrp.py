"""AttnLRP (methods/attnlrp.py): relevance conserved where every rule conserves, the foil as a difference, the
model's own forward values, the hooks gone afterwards, equality with lxt (the authors' package) where a Python with
lxt is given, and bad input in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from mixlens.errors import MixlensError
from mixlens.methods import get
from mixlens.methods.saliency import scalar_fn
from tests.conftest import random_lens

TEXTS = ["The keys to the cabinet are on the table.", "Short one."]
CAUSAL = "AutoModelForCausalLM"
CLASSIFIER = "AutoModelForSequenceClassification"


def _run(lens, **options):
    tr = lens.trace(lens.encode(TEXTS))
    return tr, get("attnlrp").run(tr, **options)


def _without_biases(model: torch.nn.Module) -> None:
    """Zero every bias, position / token-type embedding (and GPT-2's row 0 of the word embeddings, which it adds
    for token_type_ids = 0): the parts of a network that absorb relevance."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or any(k in name for k in ("position_embeddings", "wpe", "token_type")):
                p.zero_()
            if name.endswith("wte.weight"):
                p[0].zero_()


@pytest.mark.parametrize(
    ("family", "head"),
    [
        ("gpt2", CAUSAL),
        ("llama", CAUSAL),
        ("gemma3_text", CAUSAL),
        ("gemma2", CAUSAL),
        ("bert", CLASSIFIER),
        ("llama", CLASSIFIER),
        ("roberta", CLASSIFIER),
        ("qwen3", CAUSAL),  # q/k norms
        ("starcoder2", CAUSAL),  # LayerNorm, ungated FFN
        ("phi3", CAUSAL),  # fused qkv and [gate | up] projections
    ],
)
def test_conservation_is_exact_where_every_rule_conserves(family, head, tokenizer):
    """With the attention weights held constant (variant 'cp') and no biases, every rule left (identity for norms
    and activations, uniform for the gated product, ε → 0 for linear maps) conserves: Σ_j R_j = g(x) to float
    precision. Gemma 2's logit soft-capping (tanh, identity rule) and the classifiers' tanh heads included."""
    lens = random_lens(family, tokenizer, head=head, **({"num_labels": 2} if head == CLASSIFIER else {}))
    _without_biases(lens.model)
    tr, out = _run(lens, variant="cp")
    _, _, _, g, _ = scalar_fn(tr)
    assert torch.allclose(out.values.sum(-1), g, atol=1e-5 * float(g.abs().max()) + 1e-7)
    assert float(out.extras["conservation"].abs().max()) <= 1e-5 * float(g.abs().max()) + 1e-7


@pytest.mark.parametrize(
    ("family", "head"), [("gpt2", CAUSAL), ("llama", CAUSAL), ("gemma3_text", CAUSAL), ("bert", CLASSIFIER)]
)
def test_conservation_extra_is_the_sum_minus_the_models_own_scalar(family, head, tokenizer):
    """The relevance is explained against the model's own value, read from a plain forward pass (the hooks change
    gradients, never values): Σ_j R_j − conservation = logit(target) at the last real token (or the class)."""
    lens = random_lens(family, tokenizer, head=head, **({"num_labels": 2} if head == CLASSIFIER else {}))
    target = 7 if head == CAUSAL else 1
    tr, out = _run(lens, target=target)
    with torch.no_grad():
        logits = lens.model(**tr.inputs).logits
    if head == CAUSAL:
        logits = logits[torch.arange(len(TEXTS)), tr.mask.sum(-1) - 1]  # at the last real token
    want = logits[:, target]
    sums = out.values.sum(-1) - out.extras["conservation"]
    assert torch.allclose(sums, want, atol=1e-6)
    assert torch.isfinite(out.values).all() and (out.values[~tr.mask] == 0).all()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_foil_is_the_difference_of_two_targets(family, tokenizer):
    """The modified backward pass is linear in its seed: R(target − foil) = R(target) − R(foil)."""
    lens = random_lens(family, tokenizer, head=CAUSAL)
    _, both = _run(lens, target=11, foil=22)
    _, a = _run(lens, target=11)
    _, b = _run(lens, target=22)
    assert torch.allclose(both.values, a.values - b.values, atol=1e-6)


def test_batch_equals_one_by_one_and_hooks_are_removed(tokenizer):
    lens = random_lens("llama", tokenizer, head=CAUSAL)
    full = lens.trace(lens.encode(TEXTS))
    before = get("grad_x_input")(full, target=5, reduction="sum")
    _, batch = _run(lens, target=5)
    for b, text in enumerate(TEXTS):
        tr = lens.trace(lens.encode([text]))
        one = get("attnlrp")(tr, target=5)
        n = one.shape[1]
        assert torch.allclose(batch.values[b, :n], one[0], atol=1e-6)
    for m in lens.model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, type(m).__name__
    assert torch.equal(get("grad_x_input")(full, target=5, reduction="sum"), before)  # nothing left patched


def test_attnlrp_differs_from_gradient_x_input_and_cp(tokenizer):
    """The rules change the gradient (else they would not be applied)."""
    lens = random_lens("llama", tokenizer, head=CAUSAL)
    tr, out = _run(lens)
    gxi = get("grad_x_input")(tr, reduction="sum")
    cp = get("attnlrp")(tr, variant="cp")
    assert float((out.values - gxi).abs().max()) > 1e-3
    assert float((out.values - cp).abs().max()) > 1e-3


def test_bad_input_is_one_line(tokenizer):
    lens = random_lens("gpt2", tokenizer, head=CAUSAL)
    tr = lens.trace(lens.encode(TEXTS))
    for options, match in [
        ({"variant": "zennit"}, "variant must be one of attnlrp, cp"),
        ({"target": 3, "foil": 3}, "is the target itself"),
        ({"position": 99}, "position must be a token index below"),
    ]:
        with pytest.raises(MixlensError, match=match) as e:
            get("attnlrp").run(tr, **options)
        assert "\n" not in str(e.value)
    enc = random_lens("bert", tokenizer)  # a sentence encoder: one target, no foil
    with pytest.raises(MixlensError, match="pooled embedding"):
        get("attnlrp").run(enc.trace(enc.encode(TEXTS)), foil=3)


# ---- equality with lxt (the authors' package) --------------------------------------------------------------------
# lxt 2.1 (the newest release) imports only with transformers < 5, so it runs in its own interpreter:
# MIXLENS_LXT_PYTHON=/path/to/python (a venv with torch, lxt and transformers 4.x). Skipped otherwise.
LXT_SCRIPT = r"""
import importlib, json, sys
import torch, transformers as T
from lxt.efficient import monkey_patch
path, spec = sys.argv[1], json.loads(sys.argv[2])
cfg = T.AutoConfig.from_pretrained(path)
mt = cfg.model_type.replace("_text", "")
rules = importlib.import_module(f"lxt.efficient.models.{mt}")
monkey_patch(importlib.import_module(f"transformers.models.{mt}.modeling_{mt}"),
             rules.cp_LRP if spec["variant"] == "cp" else rules.attnLRP)
model = T.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
out = []
for row in spec["inputs"]:
    kw = {k: torch.tensor([v]) for k, v in row.items() if k != "input_ids"}
    emb = model.get_input_embeddings()(torch.tensor([row["input_ids"]])).detach().requires_grad_()
    logits = model(inputs_embeds=emb, **kw).logits[0, -1]
    g = logits[spec["target"]] - (logits[spec["foil"]] if spec["foil"] is not None else 0)
    g.backward()
    out.append((emb.grad * emb).sum(-1)[0].tolist())
print(json.dumps(out))
"""


def lxt_python() -> str:
    exe = os.environ.get("MIXLENS_LXT_PYTHON")
    if not exe:
        pytest.skip("set MIXLENS_LXT_PYTHON to a Python with lxt (and transformers < 5) to compare with lxt")
    return exe


@pytest.mark.parametrize("variant", ["attnlrp", "cp"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_equals_lxt(family, variant, tokenizer, tmp_path):
    """mixlens' hooks give lxt's relevance (its monkey-patched modelling code) on random models of three families,
    with and without a foil."""
    exe = lxt_python()
    lens = random_lens(family, tokenizer, head=CAUSAL)
    lens.model.save_pretrained(tmp_path / "model")
    script = tmp_path / "lxt_relevance.py"
    script.write_text(LXT_SCRIPT)
    enc = lens.encode(TEXTS)
    tr = lens.trace(enc)
    rows = [{k: v[b][: int(tr.mask[b].sum())].tolist() for k, v in enc.inputs.items()} for b in range(len(TEXTS))]
    for foil in (None, 2000):
        spec = {"inputs": rows, "target": 1000, "foil": foil, "variant": variant}
        run = subprocess.run(
            [exe, str(script), str(tmp_path / "model"), json.dumps(spec)], capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stderr[-2000:]
        theirs = json.loads(run.stdout.strip().splitlines()[-1])
        ours = get("attnlrp")(tr, target=1000, foil=foil, variant=variant)
        for b, rel in enumerate(theirs):
            want = torch.tensor(rel)
            assert torch.allclose(ours[b, : len(rel)], want, atol=1e-6 * float(want.abs().max()) + 1e-7), (b, foil)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_only_trace_installs_hooks_on_a_model():
    """trace.py is the one place that touches the model: no other module registers hooks on one or reaches for
    trace's private lock (AttnLRP's rules go through `trace.scoped_hooks`)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "src" / "mixlens"
    words = ("register_forward", "register_full_backward", "_model_lock")
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "trace.py" and any(w in p.read_text(encoding="utf-8") for w in words)
    ]
    assert offenders == []


def test_scoped_hooks_hold_the_model_and_are_removed_on_error(tokenizer):
    """`scoped_hooks`: the hooks act inside the context only (also when it ends in an error), and another thread's
    trace of the same model waits until the context ends."""
    import threading

    from mixlens.trace import scoped_hooks

    lens = random_lens("llama", tokenizer)
    enc = lens.encode(["A short input."])
    lay = lens.adapter.layers[0]
    calls: list[int] = []
    traced = threading.Event()

    def trace_in_thread() -> None:
        with torch.no_grad():
            lens.trace(enc)
        traced.set()

    hook = (lay.ffn_out, lambda m, a, o: calls.append(1))
    with pytest.raises(RuntimeError, match="stop"), scoped_hooks(lens.adapter, [hook]):
        with torch.no_grad():
            lens.trace(enc)  # the same thread may trace inside
        assert calls == [1]
        other = threading.Thread(target=trace_in_thread)
        other.start()
        assert not traced.wait(0.5)  # the other thread's trace waits for the model
        raise RuntimeError("stop")
    other.join(60)
    assert traced.is_set() and calls == [1]  # removed: the other thread's pass did not call it
    assert not lay.ffn_out._forward_hooks


FUSED_CASES = [
    ("gpt2", CAUSAL),
    ("llama", CAUSAL),
    ("gemma3_text", CAUSAL),
    ("gemma2", CAUSAL),
    ("bert", CLASSIFIER),
    ("mpnet", CLASSIFIER),
]


@pytest.mark.parametrize(("family", "head"), FUSED_CASES)
def test_fused_attention_equals_the_eager_path(family, head, tokenizer, monkeypatch):
    """AttnLRP's pass through torch's fused attention gives the eager path's relevance to 1e-5 (float32; a padded
    batch: the mask goes in as a tensor, a causal-only one as is_causal), on every supported decoder family (Gemma 2's
    soft-capped attention and MPNet's own route stay eager)."""
    from mixlens.methods import saliency

    lens = random_lens(family, tokenizer, head=head)
    got = {}
    for fused in (False, True):
        monkeypatch.setattr(saliency, "FUSED_ATTENTION", fused)
        for texts in (TEXTS, TEXTS[:1]):  # padded, and one input (causal-only mask)
            tr = lens.trace(lens.encode(texts))
            got[fused, len(texts)] = get("attnlrp").run(tr).values
    for k in (1, 2):
        ref = got[False, k]
        scale = max(1.0, float(ref.abs().max()))
        assert float((got[True, k] - ref).abs().max()) / scale < 1e-5


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3_text"])
def test_the_backward_keeps_no_attention_matrix(family, tokenizer):
    """The tensors AttnLRP's forward saves for its backward hold no [B, H, n, n] attention: the fused kernels
    recompute it blockwise (the eager path kept one per layer: 9.8 GB on SmolLM2 at 2,013 tokens)."""
    from mixlens.methods.attnlrp import lrp_rules

    lens = random_lens(family, tokenizer, head=CAUSAL)
    tr = lens.trace(lens.encode(TEXTS))
    n, heads = tr.mask.shape[1], lens.adapter.n_heads
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), lrp_rules(tr.adapter, tr.model):
        scalar_fn(tr, grad=True)
    assert shapes and not [s for s in shapes if len(s) == 4 and s[1] == heads and s[2:] == (n, n)]


def _lrp_families() -> list[tuple[str, str]]:
    """Every family of the tests' configurations that AttnLRP supports (the registry's `supports`), with the head it
    is tested on: the causal LM for decoders, a classifier for encoders (the base model where there is none)."""
    from mixlens.methods.registry import get as get_info
    from tests.conftest import FAMILIES, family_of, has_head

    out = []
    for key in FAMILIES:
        fam = family_of(key)
        if get_info("attnlrp").supports(fam) is not None:
            continue
        head = CAUSAL if fam.causal else CLASSIFIER if has_head(key, CLASSIFIER) else "AutoModel"
        out.append((key, head))
    return out


def _small_biased_llama(tokenizer):
    """A Llama with every bias on and random (q/k/v/o and the FFN's), random norm scales, and word embeddings
    scaled to 1e-3 (activations of the order of the norms' ε): the rules' non-conserving and ε terms all matter."""
    lens = random_lens("llama", tokenizer, head=CAUSAL, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-6)
    with torch.no_grad():
        for name, p in lens.model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.uniform_(0.3, 1.3)
        lens.model.get_input_embeddings().weight.mul_(1e-3)
    return lens


@pytest.mark.parametrize(("family", "head"), [*_lrp_families(), ("llama-small-biased", CAUSAL)])
def test_recomputed_layers_equal_the_kept_ones(family, head, tokenizer, monkeypatch):
    """AttnLRP with each layer recomputed in the backward (activation checkpointing, the rules' hooks live) gives the
    relevance and the conservation extra of the pass that keeps every layer's activations, to 1e-5 of the largest
    (float32), for both variants, a padded batch and one input, on every family AttnLRP supports (and a small-norm
    Llama with random biases)."""
    from mixlens.methods import attnlrp

    if family == "llama-small-biased":
        lens = _small_biased_llama(tokenizer)
    else:
        lens = random_lens(family, tokenizer, head=head, **({"num_labels": 2} if head == CLASSIFIER else {}))
    for variant in attnlrp.VARIANTS:
        for texts in (TEXTS, TEXTS[:1]):
            tr = lens.trace(lens.encode(texts))
            got = {}
            for recompute in (False, True):
                monkeypatch.setattr(attnlrp, "RECOMPUTE_LAYERS", recompute)
                out = get("attnlrp").run(tr, variant=variant)
                got[recompute] = (out.values, out.extras["conservation"])
            for k in (0, 1):
                ref = got[False][k]
                scale = max(1e-30, float(ref.abs().max()))
                assert float((got[True][k] - ref).abs().max()) / scale < 1e-5, (variant, len(texts), k)
            assert float(got[True][0].abs().max()) > 0


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_recomputed_pass_keeps_no_layer_activations(family, tokenizer, monkeypatch):
    """With the layers recomputed, the forward saves nothing of a layer for its backward but its input (no FFN
    activation [B, n, d_ff]; 4 layers save two [B, n, d] more than 2 layers), where the pass that keeps them saves
    dozens of tensors a layer. The rules' hooks and the layers'
    recomputing forward are gone afterwards."""
    from mixlens.methods import attnlrp

    saved: dict[tuple[bool, int], list[tuple[int, ...]]] = {}
    for layers in (2, 4):
        sizes: dict = {"n_layer": layers} if family == "gpt2" else {"num_hidden_layers": layers}
        if family == "gemma2":
            sizes["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
        lens = random_lens(family, tokenizer, head=CAUSAL, **sizes)
        tr = lens.trace(lens.encode(TEXTS))
        for recompute in (False, True):
            monkeypatch.setattr(attnlrp, "RECOMPUTE_LAYERS", recompute)
            shapes: list[tuple[int, ...]] = []

            def pack(t: torch.Tensor, shapes: list = shapes) -> torch.Tensor:
                shapes.append(tuple(t.shape))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                get("attnlrp").run(tr)
            saved[recompute, layers] = shapes
        for m in lens.model.modules():
            assert not m._forward_hooks and not m._forward_pre_hooks and "forward" not in vars(m)
    cfg = lens.model.config
    d_ff = 4 * cfg.n_embd if family == "gpt2" else cfg.intermediate_size
    assert any(s[-1:] == (d_ff,) for s in saved[False, 2])
    assert not any(s[-1:] == (d_ff,) for s in saved[True, 2] + saved[True, 4])
    more = {k: Counter(saved[k, 4]) - Counter(saved[k, 2]) for k in (False, True)}
    assert more[False].total() > 10 * 2  # each layer's activations
    b, n = tr.mask.shape
    assert more[True] == Counter({(b, n, 64): 2})  # each layer's input (d = 64), nothing else


def test_a_method_running_its_own_pass_keeps_the_shared_trace_in_row_mode(tokenizer):
    """`explain --method alti_logit,attnlrp,logit_attn` on a causal LM: AttnLRP reads nothing of the shared trace, so
    the trace stays in row mode (q and K per layer, no [B, H, n, n] α: the 2,048-token case held 30 layers' α because
    AttnLRP was counted as a method needing them)."""
    from mixlens.pipeline import qk_trace

    lens = random_lens("llama", tokenizer, head=CAUSAL)
    assert qk_trace(["alti_logit", "logit_attn"], lens.adapter)
    assert qk_trace(["alti_logit", "attnlrp", "logit_attn"], lens.adapter)
    assert not qk_trace(["attnlrp"], lens.adapter)  # nothing reads the trace: no trace is run at all
    tr = lens.trace_for(lens.encode(TEXTS), ["alti_logit", "attnlrp", "logit_attn"])
    assert all(lt.qk is not None and lt.alpha.numel() == 0 for lt in tr.layers)
