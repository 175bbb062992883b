"""`mixlens evaluate`: top-k selection, perturbations, metrics against a direct re-computation, JSON, bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from mixlens.errors import MixlensError
from mixlens.explain.evaluate import AOPC_KS, KS, bootstrap, evaluate, perturb, spearman, top_k
from tests.conftest import random_lens, run_cli

TEXTS = [
    "a charming and often affecting journey .",
    "unflinchingly bleak and desperate",
    "the keys to the cabinet are on the table .",
]


@pytest.fixture(scope="module")
def classifier(tokenizer):
    return random_lens("bert", tokenizer, head="AutoModelForSequenceClassification", seed=1)


def test_top_k_ties_rounding_and_specials():
    score = np.array([9.0, 1.0, 3.0, 3.0, 0.5, 3.0, 9.0])
    special = np.array([True, False, False, False, False, False, True])
    assert top_k(score, special, 1).tolist() == [2]  # ⌈0.05⌉ = 1; tie among 2, 3, 5 → earliest
    assert top_k(score, special, 40).tolist() == [2, 3]  # ⌈2.0⌉ = 2
    assert top_k(score, special, 41).tolist() == [2, 3, 5]  # ⌈2.05⌉ = 3
    assert top_k(score, special, 70).tolist() == [1, 2, 3, 5]  # ⌈3.5⌉ = 4; the 9.0 scores are special
    assert top_k(score, special, 100).tolist() == [1, 2, 3, 4, 5]


def test_perturb_delete_mask_keep():
    ids, special = [101, 7, 8, 9, 102], np.array([True, False, False, False, True])
    chosen = np.array([2])
    assert perturb(ids, chosen, special, False, "delete", 103) == (101, 7, 9, 102)
    assert perturb(ids, chosen, special, False, "mask", 103) == (101, 7, 103, 9, 102)
    assert perturb(ids, chosen, special, True, "delete", 103) == (101, 8, 102)
    assert perturb(ids, chosen, special, True, "mask", 103) == (101, 103, 8, 103, 102)


def test_spearman_and_bootstrap():
    rng = np.random.default_rng(0)
    a, b = rng.random(12), rng.random(12)
    b[3] = b[4]
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic)
    assert math.isnan(spearman(a, np.ones(12)))
    v = rng.random(50)
    lo, hi = bootstrap(v, seed=0)
    assert lo < v.mean() < hi and bootstrap(v, seed=0) == [lo, hi]


def _f(lens, ids: list[int], cls: int) -> float:
    with torch.no_grad():
        x = torch.tensor([ids])
        out = lens.model(input_ids=x, attention_mask=torch.ones_like(x), token_type_ids=torch.zeros_like(x))
    return float(out.logits[0].softmax(-1)[cls])


def _top(s: np.ndarray, inner: list[int], pct: float) -> list[int]:
    k = math.ceil(pct * len(inner) / 100 - 1e-9)
    return sorted(sorted(inner, key=lambda j: (-s[j], j))[:k])


def _without(ids: list[int], drop: list[int], removal: str, mask_id: int) -> list[int]:
    if removal == "delete":
        return [t for j, t in enumerate(ids) if j not in drop]
    return [mask_id if j in drop else t for j, t in enumerate(ids)]


@pytest.mark.parametrize("removal", ["delete", "mask"])
def test_metrics_match_a_direct_recomputation(classifier, removal):
    ev = evaluate(classifier, TEXTS[:2], ["attention", "grad_x_input"], removal=removal, batch_size=2)
    assert ev.methods == ["attention", "grad_x_input", "random"]
    met = ev.metrics()
    mask_id = classifier.tokenizer.mask_token_id
    per_metric: dict[str, list[float]] = {k: [] for k in ("comprehensiveness", "sufficiency", "aopc")}
    for e in ev.examples:
        enc = classifier.tokenizer(e.text)
        ids = enc["input_ids"]
        assert e.ids == ids
        cls = int(np.argmax([_f(classifier, ids, c) for c in range(2)]))
        f0 = _f(classifier, ids, cls)
        assert e.f == pytest.approx(f0, abs=1e-5)
        s = np.asarray(e.scores["attention"])
        inner = list(range(1, len(ids) - 1))  # [CLS] and [SEP] are never removed

        comp = np.mean([f0 - _f(classifier, _without(ids, _top(s, inner, k), removal, mask_id), cls) for k in KS])
        suff = np.mean(
            [
                f0
                - _f(classifier, _without(ids, [j for j in inner if j not in _top(s, inner, k)], removal, mask_id), cls)
                for k in KS
            ]
        )
        aopc = np.mean([f0 - _f(classifier, _without(ids, _top(s, inner, k), removal, mask_id), cls) for k in AOPC_KS])
        for name, v in (("comprehensiveness", comp), ("sufficiency", suff), ("aopc", aopc)):
            per_metric[name].append(v)
    for name, vals in per_metric.items():
        assert met["attention"][name] == pytest.approx(float(np.mean(vals)), abs=1e-5), name
        lo, hi = met["attention"]["ci95"][name]
        assert lo <= met["attention"][name] <= hi
    rho = np.mean([spearmanr(e.scores["grad_x_input"][1:-1], e.reference[1:-1]).statistic for e in ev.examples])
    assert met["grad_x_input"]["spearman_gxi"] == pytest.approx(float(rho), abs=1e-6)


def test_causal_lm_evaluation(tokenizer):
    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM", seed=2)
    ev = evaluate(lens, TEXTS[:2], ["decompx_logit", "saliency", "attention"])
    enc = lens.encode(TEXTS[:1])
    with torch.no_grad():
        p = lens.model(**enc.inputs).logits[0, -1].softmax(-1)
    assert ev.examples[0].f == pytest.approx(float(p.max()), abs=1e-6)
    assert ev.examples[0].target["label"] == tokenizer.convert_ids_to_tokens(int(p.argmax()))
    assert set(ev.metrics()) == {"decompx_logit", "saliency", "attention", "random"}


def test_removal_none_keeps_only_the_agreement(classifier, tmp_path):
    from mixlens.viz.evaluation import plot
    from mixlens.viz.terminal import print_evaluation

    full = evaluate(classifier, TEXTS[:3], ["attention", "grad_x_input"])
    ev = evaluate(classifier, TEXTS[:3], ["attention", "grad_x_input"], removal="none")
    met = ev.metrics()
    for m in ("attention", "grad_x_input", "random"):
        assert np.isnan(met[m]["aopc"]) and np.isnan(met[m]["sufficiency"])
        assert met[m]["spearman_gxi"] == pytest.approx(full.metrics()[m]["spearman_gxi"])
    assert ev.ranking()[0] == max(met, key=lambda m: met[m]["spearman_gxi"])  # ranked by the agreement
    assert ev.curves() == {}
    plot(ev, tmp_path / "none.png")
    assert (tmp_path / "none.png").stat().st_size > 1000
    print_evaluation(ev)  # '-' for the removal metrics, no error


def test_mask_removal_needs_a_mask_token(classifier):
    from copy import deepcopy

    tok = deepcopy(classifier.tokenizer)
    tok.mask_token = None
    lens = type(classifier)(classifier.model, tok, name="no-mask")
    with pytest.raises(MixlensError, match="needs a model with a mask token"):
        evaluate(lens, TEXTS, ["attention"], removal="mask")


@pytest.fixture(scope="module")
def saved(tmp_path_factory, classifier):
    d = tmp_path_factory.mktemp("clf")
    classifier.model.save_pretrained(d)
    classifier.tokenizer.save_pretrained(d)
    return d


def test_cli_json_schema(saved, tmp_path, capsys):
    data = tmp_path / "d.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{t}\t1\n" for t in TEXTS))
    out = tmp_path / "ev"
    rc, stdout, _ = run_cli(
        [
            "evaluate",
            "--model",
            str(saved),
            "--data",
            str(data),
            "--method",
            "attention",
            "--skip",
            "1",
            "--format",
            "json",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert rc == 0
    doc = json.loads(stdout)
    assert doc == json.loads((out / "evaluation.json").read_text()) and (out / "evaluation.png").is_file()
    assert {"model", "version", "removal", "metrics", "examples"} <= set(doc)
    assert set(doc["metrics"]) == {"attention", "random"}
    for row in doc["metrics"].values():
        assert {"comprehensiveness", "sufficiency", "aopc", "spearman_gxi", "ci95"} <= set(row)
        assert set(row["ci95"]) == {"comprehensiveness", "sufficiency", "aopc", "spearman_gxi"}
    assert [e["text"] for e in doc["examples"]] == TEXTS[1:]
    for e in doc["examples"]:
        assert {"text", "tokens", "target", "f", "scores"} <= set(e)
        assert all(len(v) == len(e["tokens"]) for v in e["scores"].values())
    rc, stdout, _ = run_cli(
        [
            "evaluate",
            "--model",
            str(saved),
            "--data",
            str(data),
            "--method",
            "attention",
            "--limit",
            "1",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert rc == 0 and "AOPC" in stdout and "own" in stdout


def test_cli_bad_input(saved, tmp_path, capsys):
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    dest = tmp_path / "never"
    for args, msg in (
        (["--data", str(empty)], "empty"),
        (["--data", str(tmp_path / "nope.tsv")], "does not exist"),
        (["--data", str(empty), "--removal", "zap"], "unknown removal"),
    ):
        rc, _, err = run_cli(["evaluate", "--model", str(saved), "--out", str(dest), *args], capsys)
        assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1 and not dest.exists()


def test_an_emptied_input_is_read_as_the_start_token(tokenizer):
    from mixlens.explain.scoring import forward_f

    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM", seed=2)
    start = next(t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.cls_token_id) if t is not None)
    idx = torch.tensor([5])
    f = forward_f(lens, "causal", "", [(), (start,)], [0, 0], idx, torch.zeros(1, 1))
    assert f[0] == f[1] and 0 < f[0] < 1


def test_cli_mask_removal_without_a_mask_token_writes_nothing(classifier, tmp_path, capsys):
    from copy import deepcopy

    tok = deepcopy(classifier.tokenizer)
    tok.mask_token = None
    model_dir = tmp_path / "no-mask"
    classifier.model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "d.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{t}\t1\n" for t in TEXTS))
    dest = tmp_path / "never"
    rc, out, err = run_cli(
        [
            "evaluate",
            "--model",
            str(model_dir),
            "--data",
            str(data),
            "--removal",
            "mask",
            "--method",
            "attention",
            "--out",
            str(dest),
        ],
        capsys,
    )
    assert rc == 2 and "needs a model with a mask token" in err and len(err.strip().splitlines()) == 1
    assert not dest.exists() and out == ""


def test_cli_model_head_and_its_deprecated_alias(saved, tmp_path, capsys):
    data = tmp_path / "d.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{t}\t1\n" for t in TEXTS[:1]))
    base = ["evaluate", "--model", str(saved), "--data", str(data), "--method", "attention", "--format", "json"]
    rc, out, err = run_cli([*base, "--model-head", "sequence-classification", "--out", str(tmp_path / "a")], capsys)
    assert rc == 0 and "deprecated" not in err
    new = json.loads(out)
    rc, out, err = run_cli([*base, "--head", "sequence-classification", "--out", str(tmp_path / "b")], capsys)
    assert rc == 0 and "--head is deprecated" in err
    assert json.loads(out)["metrics"]["attention"]["aopc"] == new["metrics"]["attention"]["aopc"]
    rc, _, err = run_cli([*base, "--model-head", "base", "--head", "causal-lm", "--out", str(tmp_path / "c")], capsys)
    assert rc == 2 and "give the model head once" in err and not (tmp_path / "c").exists()


def test_notes_name_the_methods_left_out(classifier):
    ev = evaluate(classifier, TEXTS[:1], ["attention"])
    assert ev.notes[0].startswith("not evaluated: ") and "decompx_classes" in ev.notes[0]
    assert any("left out of the default set" in n and "hta" in n for n in ev.notes)
    assert not any("hta" in n for n in evaluate(classifier, TEXTS[:1], ["attention", "hta"]).notes)


def test_shared_attributions_and_the_json_round_trip(classifier):
    from mixlens.explain.evaluate import Evaluation, evaluate_removals

    both = evaluate_removals(
        classifier, TEXTS, ["attention", "grad_x_input"], removals=("delete", "mask"), batch_size=2
    )
    for removal, ev in both.items():
        alone = evaluate(classifier, TEXTS, ["attention", "grad_x_input"], removal=removal, batch_size=2)
        assert ev.removal == removal and ev.metrics() == alone.metrics()
        t = ev.timings
        assert t["total"] == pytest.approx(t["attributions"] + t["forward"] + t["own"]) and t["own"] > 0
        back = Evaluation.from_json(json.loads(ev.dumps()))
        assert back.metrics() == ev.metrics() and back.curves() == ev.curves() and back.removal == removal
    assert both["delete"].metrics() != both["mask"].metrics()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_causal_f_unembeds_only_the_last_positions(tokenizer, family):
    """`forward_f` on a causal LM (logits of the last real positions only) equals the full-logits definition."""
    from mixlens.explain.scoring import forward_f, keeps_logits

    lens = random_lens(family, tokenizer, head="AutoModelForCausalLM", seed=3)
    assert keeps_logits(lens.model)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    seqs = [tuple(ids[0]), tuple(ids[1]), tuple(ids[2]), tuple(ids[2][:4]), tuple(ids[0][:2])]
    owners, index = [0, 1, 2, 2, 0], torch.tensor([7, 11, 13])
    got = forward_f(lens, "causal", "", seqs, owners, index, torch.zeros(3, 1))
    for s, o, g in zip(seqs, owners, got, strict=True):
        with torch.no_grad():
            p = lens.model(**lens.encode_ids([s]).inputs).logits[0, -1].softmax(-1)[index[o]]
        assert g == pytest.approx(float(p), rel=1e-5, abs=1e-7)


def test_non_finite_scores_are_noted(classifier, monkeypatch):
    from mixlens.explain import attributions as attr

    real = attr.attribute

    def overflowing(*args, **kwargs):
        out = real(*args, **kwargs)
        out["attention"][0, 1] = float("inf")
        return out

    monkeypatch.setattr(attr, "attribute", overflowing)
    ev = evaluate(classifier, TEXTS, ["attention", "saliency"], batch_size=2)
    assert "attention: non-finite scores (overflow) on 2 of 3 inputs; its ranks are arbitrary" in ev.notes
    assert not any(n.startswith("saliency") for n in ev.notes)


def test_figure_title_names_the_model_not_its_path():
    from mixlens.viz.evaluation import model_label

    assert model_label("/root/.cache/mixlens/models/smollm2-135m-instruct/") == "smollm2-135m-instruct"
    assert model_label("sentence-transformers/all-MiniLM-L6-v2") == "all-MiniLM-L6-v2"
    assert model_label("bert-base-uncased") == "bert-base-uncased"


def test_table_fits_a_100_column_terminal(classifier, monkeypatch, capsys):
    """The evaluate table (every default method, intervals under the means) fits a 100-column terminal."""
    import os
    import shutil

    from mixlens.viz.terminal import print_evaluation

    ev = evaluate(classifier, TEXTS[:2], batch_size=2)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=(100, 24): os.terminal_size((100, 24)))
    print_evaluation(ev)
    lines = capsys.readouterr().out.splitlines()
    table = [ln for ln in lines if not ln.startswith(("time:", "note:"))]
    assert max(len(ln) for ln in table) <= 100 and any("integrated_gradients" in ln for ln in table)
