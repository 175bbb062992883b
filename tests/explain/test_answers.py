"""Answers (`explain(..., answer=)` / `generate=`): every answer token explained from one forward pass of prompt +
answer. Row a of each decomposition equals the single-token explanation of prompt + answer[:a] with target
answer[a] (computed through the plain single-token path on that prefix), the decompositions sum back to the model's
own logits, the gradient rows are the gradients of each token's log-probability (computed here with a plain
forward and autograd), and the result round-trips through JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mixlens.errors import MixlensError
from mixlens.explain import explain
from mixlens.explain.answers import answer_prompt
from mixlens.pipeline import run_methods
from mixlens.result import Explanation
from tests.conftest import random_lens

PROMPT = "The keys to the cabinet"
ANSWER = " are on the table"
DECOMPOSITIONS = ["logit_attn", "alti_logit", "decompx_logit", "flow_routes_tokens"]
MAPS = ["attention_rollout", "alti_rollout", "norm_rollout", "norm_res_rollout", "norm_resln_rollout"]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def causal(request, tokenizer):
    lens = random_lens(request.param, tokenizer, head="AutoModelForCausalLM")
    lens.model.eval()  # the plain forward passes of the tests: no dropout (GPT-2's config has some)
    return lens


@pytest.fixture(scope="module")
def answered(causal):
    return explain(causal, [PROMPT], DECOMPOSITIONS + MAPS + ["grad_x_input", "attnlrp"], answer=ANSWER)


def _single(lens, prefix: list[int], method: str, token: int) -> np.ndarray:
    """The single-token explanation of `prefix` → `token` through the plain path (a trace of the prefix alone, the
    method's own target options: the last token's logit)."""
    trace = lens.trace_for(lens.encode_ids([prefix]), [method], output=True)
    opts = {"target": token} if method != "flow_routes_tokens" else {}
    return run_methods(trace, [method], options={method: opts}).values[method][0].float().cpu().numpy()


def test_answer_is_one_matrix_per_method(causal, answered):
    head = answer_prompt(causal, PROMPT)
    answer = answered.explained[0]["answer"]
    m, n = len(answer["ids"]), len(head) + len(answer["ids"])
    assert answer["start"] == len(head) and answer["tokens"] == ["are", "on", "the", "table"]
    assert len(answered.tokens[0]) == n
    for name, a in answered.attributions.items():
        assert a.dims == ("target", "source") and a.rows == [list(range(len(head), n))]
        mat = a.input(0)
        assert mat.shape == (m, n), name
        for r in range(m):  # causal: row r reads only prompt + answer[:r]
            assert not np.any(mat[r, len(head) + r :]), name
        np.testing.assert_allclose(answered.inputs[0].scores[name], mat.sum(0), rtol=1e-6)


def test_decomposition_rows_equal_single_token_explanations(causal, answered):
    head = answer_prompt(causal, PROMPT)
    answer = answered.explained[0]["answer"]
    ids = head + answer["ids"]
    for name in DECOMPOSITIONS:
        mat = answered[name].input(0)
        for r, tok in enumerate(answer["ids"]):
            prefix = ids[: len(head) + r]
            single = _single(causal, prefix, name, tok)
            np.testing.assert_allclose(mat[r, : len(prefix)], single, rtol=1e-4, atol=1e-5, err_msg=name)


def test_map_rows_equal_the_prefix_maps(causal, answered):
    head = answer_prompt(causal, PROMPT)
    answer = answered.explained[0]["answer"]
    ids = head + answer["ids"]
    for name in MAPS:
        mat = answered[name].input(0)
        for r in range(len(answer["ids"])):
            prefix = ids[: len(head) + r]
            trace = causal.trace_for(causal.encode_ids([prefix]), [name], output=True)
            full = run_methods(trace, [name]).values[name][0, -1, -1].float().cpu().numpy()
            np.testing.assert_allclose(mat[r, : len(prefix)], full, rtol=1e-4, atol=1e-6, err_msg=name)


def test_decompositions_sum_to_the_real_logits(causal, answered):
    head = answer_prompt(causal, PROMPT)
    answer = answered.explained[0]["answer"]
    inputs = causal.encode_ids([head + answer["ids"]]).inputs  # as the lens feeds the model (token types too)
    with torch.no_grad():
        logits = causal.model(**inputs).logits[0].float()
    pos = [len(head) - 1 + r for r in range(len(answer["ids"]))]
    real = logits[pos, answer["ids"]].numpy()
    for name in ("logit_attn", "alti_logit"):
        rest = answered[name].extra_store["remainder"].row(0)
        total = answered[name].input(0).sum(1) + rest
        np.testing.assert_allclose(total, real, rtol=1e-4, atol=1e-4 * np.abs(logits.numpy()).max(), err_msg=name)
    np.testing.assert_allclose(answered["decompx_logit"].input(0).sum(1), real, rtol=1e-4, atol=1e-3)
    # the recorded log-probabilities are the model's own
    np.testing.assert_allclose(answer["logprobs"], logits.log_softmax(-1)[pos, answer["ids"]].numpy(), rtol=1e-5)
    assert answered.explained[0]["score"] == pytest.approx(sum(answer["logprobs"]), rel=1e-6)


def test_gradient_rows_are_each_tokens_log_probability_gradient(causal, answered):
    head = answer_prompt(causal, PROMPT)
    answer = answered.explained[0]["answer"]
    inputs = dict(causal.encode_ids([head + answer["ids"]]).inputs)
    emb = causal.model.get_input_embeddings()(inputs.pop("input_ids")).detach().requires_grad_(True)
    logp = causal.model(inputs_embeds=emb, **inputs).logits[0].float().log_softmax(-1)
    mat = answered["grad_x_input"].input(0)
    for r, tok in enumerate(answer["ids"]):
        (g,) = torch.autograd.grad(logp[len(head) - 1 + r, tok], emb, retain_graph=True)
        want = (g * emb.detach())[0].sum(-1).numpy()
        np.testing.assert_allclose(mat[r], want, rtol=1e-4, atol=1e-6)


def test_attnlrp_rows_equal_single_token_attnlrp(causal, answered):
    head = answer_prompt(causal, PROMPT)
    answer = answered.explained[0]["answer"]
    ids = head + answer["ids"]
    mat = answered["attnlrp"].input(0)
    for r, tok in enumerate(answer["ids"]):
        prefix = ids[: len(head) + r]
        np.testing.assert_allclose(mat[r, : len(prefix)], _single(causal, prefix, "attnlrp", tok), rtol=1e-4, atol=1e-5)


def test_answer_round_trips_through_json(answered, tmp_path):
    doc = json.loads(answered.dumps())
    back = Explanation.from_json(doc)
    assert isinstance(back, Explanation)
    assert back.explained == answered.explained
    for name, a in answered.attributions.items():
        np.testing.assert_allclose(back[name].input(0), a.input(0), rtol=1e-6)
        assert back[name].rows == a.rows
    np.testing.assert_allclose(
        back["logit_attn"].extra_store["remainder"].row(0),
        answered["logit_attn"].extra_store["remainder"].row(0),
        rtol=1e-6,
    )
    assert back.inputs[0].answer == answered.inputs[0].answer
    np.testing.assert_allclose(back.inputs[0].matrix["logit_attn"], answered["logit_attn"].input(0), rtol=1e-6)
    (tmp_path / "ex.json").write_text(answered.dumps())  # what `explain --answer ... --format json` writes
    loaded = Explanation.load(tmp_path / "ex.json")
    assert isinstance(loaded, Explanation)
    np.testing.assert_allclose(loaded["alti_logit"].input(0), answered["alti_logit"].input(0))
    assert loaded.explained == answered.explained


def test_generate_explains_the_greedy_answer(causal):
    ex = explain(causal, [PROMPT], ["logit_attn"], generate=3)
    answer = ex.explained[0]["answer"]
    head = answer_prompt(causal, PROMPT)
    ids = list(head)
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(causal.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert answer["ids"] == ids[len(head) :] and answer["start"] == len(head)
    assert ex["logit_attn"].input(0).shape == (3, len(ids))


def test_bad_answers(causal, tokenizer, capsys):
    with pytest.raises(MixlensError, match="empty"):
        explain(causal, [PROMPT], ["logit_attn"], answer="  ")
    with pytest.raises(MixlensError, match="drop --target"):
        explain(causal, [PROMPT], ["logit_attn"], answer=ANSWER, target="table")
    with pytest.raises(MixlensError, match="not both"):
        explain(causal, [PROMPT], ["logit_attn"], answer=ANSWER, generate=2)
    with pytest.raises(MixlensError, match="one per input"):
        explain(causal, [PROMPT, PROMPT], ["logit_attn"], answer=[ANSWER])
    clf = random_lens("bert", tokenizer, head="AutoModelForSequenceClassification")
    with pytest.raises(MixlensError, match="needs a causal language model"):
        explain(clf, [PROMPT], ["attention"], answer=ANSWER)
    short = random_lens("llama", tokenizer, head="AutoModelForCausalLM", max_position_embeddings=12)
    with pytest.raises(MixlensError, match="context"):
        explain(short, [PROMPT], ["logit_attn"], answer=ANSWER * 3)
    with pytest.raises(MixlensError, match="context"):
        explain(short, [PROMPT], ["logit_attn"], generate=20)


def test_boundary_merge_warns_and_names_the_explained_tokens(causal, capsys):
    ex = explain(causal, ["The keys to the cab"], ["logit_attn"], answer="inet is open")
    err = capsys.readouterr().err
    answer = ex.explained[0]["answer"]
    assert "tokenized differently" in err and str(answer["tokens"]) in err
    assert err.count("\n") == 1


def test_smollm2_answer_rows():
    from pathlib import Path

    import mixlens

    path = Path.home() / ".cache" / "mixlens" / "models" / "smollm2-135m-instruct"
    if not path.is_dir():
        pytest.skip("SmolLM2-135M-Instruct is not present")
    lens = mixlens.load(str(path))
    # logit_attn alone adds its rows up layer by layer in the forward (`layered_rows`); beside alti_logit it reads
    # the whole trace: both equal the single-token explanation of each answer prefix on the real model
    for names in (["logit_attn"], ["logit_attn", "alti_logit"]):
        ex = explain(lens, ["The capital of France is"], names, answer=" Paris, a city")
        answer = ex.explained[0]["answer"]
        head = answer_prompt(lens, "The capital of France is")
        ids = head + answer["ids"]
        for name in names:
            mat = ex[name].input(0)
            for r, tok in enumerate(answer["ids"]):
                single = _single(lens, ids[: len(head) + r], name, tok)
                np.testing.assert_allclose(mat[r, : len(head) + r], single, rtol=1e-4, atol=1e-4, err_msg=str(names))


def _forced(lens, prompt_ids: list[int], phrase: list[int]) -> tuple[float, float]:
    """(Σ logit, Σ log p) of `phrase` teacher-forced after `prompt_ids`, from one plain forward."""
    inputs = lens.encode_ids([prompt_ids + phrase]).inputs
    with torch.no_grad():
        logits = lens.model(**inputs).logits[0].float()
    pos = [len(prompt_ids) - 1 + a for a in range(len(phrase))]
    return float(logits[pos, phrase].sum()), float(logits.log_softmax(-1)[pos, phrase].sum())


@pytest.mark.parametrize("foil", [None, " is under the bed"])
def test_phrase_target_explains_the_summed_log_probability(causal, foil):
    ex = explain(causal, [PROMPT], ["logit_attn", "alti_logit", "grad_x_input"], target=ANSWER, foil=foil)
    t = ex.explained[0]
    head = answer_prompt(causal, PROMPT)
    phrase = t["phrase"]
    logit_t, logp_t = _forced(causal, head, phrase["target"]["ids"])
    logit_f, logp_f = (0.0, 0.0) if foil is None else _forced(causal, head, phrase["foil"]["ids"])
    assert t["kind"] == "phrase" and len(phrase["target"]["ids"]) == 4
    assert t["score"] == pytest.approx(logp_t - logp_f, rel=1e-5, abs=1e-5)
    assert len(ex.tokens[0]) == len(head)  # one score per prompt token
    for name in ("logit_attn", "alti_logit"):
        total = ex[name].input(0).sum() + phrase["within"][name] + float(ex[name].extra_store["remainder"].row(0))
        assert total == pytest.approx(logit_t - logit_f, rel=1e-4, abs=1e-4), name
    back = Explanation.from_json(json.loads(ex.dumps()))
    assert back.explained == ex.explained


def test_phrase_scalar_of_the_gradient_methods_is_the_log_probability(causal):
    ex = explain(causal, [PROMPT], ["grad_x_input"], target=ANSWER)
    head = answer_prompt(causal, PROMPT)
    phrase = ex.explained[0]["phrase"]["target"]["ids"]
    inputs = dict(causal.encode_ids([head + phrase]).inputs)
    emb = causal.model.get_input_embeddings()(inputs.pop("input_ids")).detach().requires_grad_(True)
    logp = causal.model(inputs_embeds=emb, **inputs).logits[0].float().log_softmax(-1)
    total = sum(logp[len(head) - 1 + a, t] for a, t in enumerate(phrase))
    (g,) = torch.autograd.grad(total, emb)
    gx = (g * emb.detach())[0].sum(-1).numpy()
    np.testing.assert_allclose(ex["grad_x_input"].input(0), gx[: len(head)], rtol=1e-4, atol=1e-6)
    assert ex.explained[0]["phrase"]["within"]["grad_x_input"] == pytest.approx(
        float(gx[len(head) :].sum()), rel=1e-4, abs=1e-6
    )


def test_gradient_rows_share_one_forward(causal, monkeypatch):
    """saliency, gradient × input and AttnLRP on an answer: one forward each pass family (the plain gradient's,
    AttnLRP's under its rules) plus the one that reads the answer's log-probabilities, whatever the answer's length;
    the backward passes are batched (`is_grads_batched`) when torch can vectorise them."""
    calls = []
    real = causal.model.forward
    monkeypatch.setattr(causal.model, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    batched = []
    grad = torch.autograd.grad

    def counting(*a, **k):
        batched.append(bool(k.get("is_grads_batched")))
        return grad(*a, **k)

    monkeypatch.setattr(torch.autograd, "grad", counting)
    explain(causal, [PROMPT], ["saliency", "grad_x_input", "attnlrp"], answer=ANSWER)
    assert len(calls) == 3
    assert batched and all(batched)  # 4 rows: one vectorised backward per pass family, no fallback


def test_the_decompositions_trace_keeps_the_answer_rows_logits_only(causal, monkeypatch):
    kept = []
    real = causal.trace_for

    def spy(*a, **k):
        tr = real(*a, **k)
        kept.append(None if tr.logits is None else tuple(tr.logits.shape))
        return tr

    monkeypatch.setattr(causal, "trace_for", spy)
    ex = explain(causal, [PROMPT], ["alti_logit"], answer=ANSWER)
    m = len(ex.explained[0]["answer"]["ids"])
    assert kept == [(1, m, causal.model.config.vocab_size)]  # [batch, answer rows, vocabulary], not every position


def test_logit_attn_adds_its_answer_rows_layer_by_layer(causal, answered, monkeypatch):
    """`logit_attn` alone (or with the streamed maps, or the gradient methods): one forward pass whose layers are
    dropped as soon as their terms are added, no layer kept; the rows, remainders and log-probabilities are those
    of the whole trace (`answered`, where alti_logit reads the whole trace and logit_attn with it), which sum to
    the model's logits (`test_decompositions_sum_to_the_real_logits`)."""
    import mixlens.explain.answers as answers
    import mixlens.pipeline as pipeline

    passes = []
    for module, name in ((answers, "run_traced"), (pipeline, "run_traced")):

        def spy(*a, real=getattr(module, name), **k):
            tr = real(*a, **k)
            passes.append((k.get("sink") is not None, [lt.x.numel() for lt in tr.layers], tuple(tr.logits.shape)))
            return tr

        monkeypatch.setattr(module, name, spy)
    monkeypatch.setattr(causal, "trace_for", lambda *a, **k: pytest.fail("a whole trace was made"))
    m = len(answered.explained[0]["answer"]["ids"])
    for methods in (["logit_attn"], ["logit_attn", "norm_rollout", "attention_rollout"]):
        passes.clear()
        ex = explain(causal, [PROMPT], methods, answer=ANSWER)
        assert passes == [(True, [0] * causal.adapter.n_layers, (1, m, causal.model.config.vocab_size))], methods
        np.testing.assert_allclose(ex["logit_attn"].input(0), answered["logit_attn"].input(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            ex["logit_attn"].extra_store["remainder"].row(0),
            answered["logit_attn"].extra_store["remainder"].row(0),
            rtol=1e-5,
            atol=1e-5,
        )
        np.testing.assert_allclose(
            ex.explained[0]["answer"]["logprobs"], answered.explained[0]["answer"]["logprobs"], rtol=1e-5
        )
        for name in methods[1:]:
            np.testing.assert_allclose(ex[name].input(0), answered[name].input(0), rtol=1e-5, atol=1e-7)


def test_the_norm_rollouts_build_the_answer_rows_only(causal, answered, monkeypatch):
    """The norm rollouts' answer rows come from their row mode: the full n × n product is never formed."""
    import mixlens.methods.norm_rollouts as norm_rollouts

    def full_product(*a, **k):
        raise AssertionError("the full rollout ran")

    monkeypatch.setattr(norm_rollouts, "rollout", full_product)
    names = ["norm_rollout", "norm_res_rollout", "norm_resln_rollout"]
    ex = explain(causal, [PROMPT], names, answer=ANSWER)
    for name in names:
        np.testing.assert_allclose(ex[name].input(0), answered[name].input(0), rtol=1e-6, atol=0, err_msg=name)


def test_streamed_maps_alone_take_the_log_probabilities_from_their_one_pass(causal):
    """With only streamed methods, the streamed pass also gives the answer's log-probabilities (the logits of the
    answer positions): one forward pass of the model, no second plain one (eager attention at 8k: 6 GB)."""
    calls: list[int] = []
    hook = causal.adapter.layers[0].module.register_forward_hook(lambda *a: calls.append(1))  # every pass
    try:
        ex = explain(causal, [PROMPT], ["norm_rollout", "attention_rollout"], answer=ANSWER)
    finally:
        hook.remove()
    assert len(calls) == 1
    head = answer_prompt(causal, PROMPT)
    answer = ex.explained[0]["answer"]
    inputs = causal.encode_ids([head + answer["ids"]]).inputs
    with torch.no_grad():
        logp = causal.model(**inputs).logits[0].float().log_softmax(-1)
    pos = [len(head) - 1 + r for r in range(len(answer["ids"]))]
    np.testing.assert_allclose(answer["logprobs"], logp[pos, answer["ids"]].numpy(), rtol=1e-5)


def test_more_answer_tokens_than_one_batched_backward(causal, answered, monkeypatch):
    """An answer longer than `ROWS_PER_BACKWARD` tokens takes several backward passes through the one forward, each
    recomputing the layers (activation checkpointing): every pass gives the rows one batched backward gives."""
    import mixlens.methods.saliency as saliency

    monkeypatch.setattr(saliency, "ROWS_PER_BACKWARD", 1)
    ex = explain(causal, [PROMPT], ["grad_x_input", "attnlrp"], answer=ANSWER)
    assert len(ex.explained[0]["answer"]["ids"]) > 1
    for m in ("grad_x_input", "attnlrp"):
        np.testing.assert_allclose(ex[m].input(0), answered[m].input(0), rtol=1e-5, atol=1e-7, err_msg=m)


@pytest.mark.parametrize("how", ["answer", "generate"])
def test_no_forward_unembeds_every_position(causal, how):
    """The gradient methods' pass, the answer's log-probabilities and greedy generation unembed the positions they
    read only: never [n, vocabulary] (4 GB at 4k tokens with gemma-3's 262k vocabulary, 34 GB at 32k)."""
    widths = []
    hook = causal.model.register_forward_hook(lambda mod, args, out: widths.append(out.logits.shape[1]))
    kw = {"answer": ANSWER} if how == "answer" else {"generate": 3}
    try:
        ex = explain(causal, [PROMPT], ["grad_x_input"], **kw)
    finally:
        hook.remove()
    m = len(ex.explained[0]["answer"]["ids"])
    n = len(answer_prompt(causal, PROMPT)) + m
    assert widths and max(widths) <= m < n
