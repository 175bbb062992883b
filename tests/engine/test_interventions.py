"""Disabling heads and layers (mixlens.interventions), and the ablation sweep (mixlens.bertology.sweep)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mixlens.bertology.sweep import head_means, read_sweep_csv, sweep
from mixlens.bertology.tasks import ClassificationTask, MlmTask, StsTask
from mixlens.errors import MixlensError
from mixlens.interventions import Ablation, ablated_trace, head_contexts, merged_edits
from mixlens.trace import hooked
from tests.conftest import SENTENCES, data_file, random_lens, run_cli

PAIRS = [
    ("A man is playing a guitar.", "A man plays the guitar."),
    ("A woman is slicing an onion.", "Someone is cutting an onion."),
    ("The cat sleeps.", "A plane is taking off from the runway."),
    ("Two dogs run in the park.", "Dogs are running outside."),
    ("A child is reading a book.", "The stock market fell sharply today."),
    ("Kids play soccer.", "Children are playing football on a field."),
]
GOLD = [4.8, 4.0, 0.2, 3.8, 0.0, 4.2]


def _attn_out(tr, layer, lay):
    """The real attention output (without b_O) of a layer, from the captured residual sums."""
    return tr.layers[layer].mix_in - tr.layers[layer].x - lay.b_o


def test_disabling_a_head_changes_exactly_that_head(bundled):
    enc = bundled.encode(SENTENCES)
    base, abl = bundled.trace(enc), ablated_trace(bundled, enc, [Ablation(3, (7,), "uniform")])
    zb, za = head_contexts(base), head_contexts(abl)
    m = base.mask[:, None, :, None]
    diff = ((zb - za).abs() * m[:, None]).amax((0, 3, 4))  # [L, H]
    assert diff[:3].max() == 0 and diff[3, 7] > 1e-2
    assert torch.cat([diff[3, :7], diff[3, 8:]]).max() == 0
    assert diff[4:].min() > 0  # later layers see the change


def test_uniform_equals_mean_of_values_and_the_model_uses_it(bundled):
    enc = bundled.encode(SENTENCES)
    tr = ablated_trace(bundled, enc, [Ablation(2, (5,), "uniform")])
    lay = bundled.adapter.layers[2]
    v, mask = tr.layers[2].value, tr.mask
    for b, n in enumerate(tr.lengths):
        want = v[b, 5, :n].mean(0)  # hand-computed: mean of the real value vectors
        z = head_contexts(tr)[b, 2, 5, :n]
        torch.testing.assert_close(z, want.expand_as(z), atol=1e-6, rtol=1e-5)
    # the model's own attention output is Σ_h z^h W_O^h with the edited z
    z_all = head_contexts(tr)[:, 2].transpose(1, 2).flatten(2)  # [B, n, H·d_h]
    got = _attn_out(tr, 2, lay)
    torch.testing.assert_close((z_all @ lay.w_o)[mask], got[mask], atol=1e-4, rtol=1e-4)
    assert mask.sum() > 0


def test_zero_and_mean_modes(bundled):
    enc = bundled.encode(SENTENCES)
    lay = bundled.adapter.layers[1]
    base = bundled.trace(enc)
    z0 = head_contexts(base)[:, 1]
    tr = ablated_trace(bundled, enc, [Ablation(1, (0, 4), "zero")])
    # zeroing heads 0 and 4: the attention output loses exactly their W_O images
    keep = z0.clone()
    keep[:, [0, 4]] = 0
    want = keep.transpose(1, 2).flatten(2) @ lay.w_o
    torch.testing.assert_close(_attn_out(tr, 1, lay)[base.mask], want[base.mask], atol=1e-4, rtol=1e-4)
    means = head_means(bundled, SENTENCES)
    trm = ablated_trace(bundled, enc, [Ablation(1, None, "mean")], means=means)
    want = means[1].flatten()[None] @ lay.w_o  # every position gets the mean context of every head
    got = _attn_out(trm, 1, lay)[base.mask]
    torch.testing.assert_close(got, want.expand_as(got), atol=1e-4, rtol=1e-4)


def test_causal_uniform_is_over_allowed_keys(tokenizer):
    lens = random_lens("gpt2", tokenizer)
    enc = lens.encode(SENTENCES)
    tr = ablated_trace(lens, enc, [Ablation(0, None, "uniform")])
    a = tr.layers[0].alpha[0, 2]
    n = tr.lengths[0]  # compare the real block of input 0
    want = torch.ones(n, n).tril()
    want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(a[:n, :n], want)


def test_bad_ablations(bundled):
    from mixlens.errors import MixlensError

    mask = torch.ones(1, 3, dtype=torch.bool)
    for ab, msg in [
        (Ablation(9, None), "out of range"),
        (Ablation(0, (12,)), "out of range"),
        (Ablation(0, None, "bogus"), "unknown ablation mode"),
        (Ablation(0, None, "mean"), "head means"),
    ]:
        with pytest.raises(MixlensError, match=msg):
            merged_edits(bundled, [ab], mask)


def _direct(lens, task, ablations, means=None) -> float:
    """Score a task with the full model and `merged_edits` (no layer skipping, no stacking)."""
    parts = []
    extra = {"use_cache": False} if lens.adapter.family.causal else {}
    with torch.no_grad():
        for i, inputs in enumerate(task.batches):
            edits = merged_edits(lens, ablations, inputs["attention_mask"].bool(), means) if ablations else {}
            with hooked(lens.adapter, edits):
                out = lens.model(**inputs, **extra)
            parts.append(task.collect(out, i))
    return task.score(parts)


def test_sweep_sts_equals_direct_ablation(bundled):
    task = StsTask(bundled, PAIRS, GOLD, batch_size=5)
    res = sweep(bundled, task, "uniform")
    assert res.heads.shape == (6, 12) and res.layers.shape == (6,)
    assert res.baseline == pytest.approx(_direct(bundled, task, []), abs=1e-9)
    for layer, head in [(0, 3), (4, 11)]:
        assert res.heads[layer, head] == pytest.approx(_direct(bundled, task, [Ablation(layer, (head,))]), abs=1e-6)
    assert res.layers[5] == pytest.approx(_direct(bundled, task, [Ablation(5, None)]), abs=1e-6)
    # hand-computed baseline: mean pooling + cosine + Spearman
    from scipy.stats import spearmanr

    with torch.no_grad():
        embs = []
        for a, b in PAIRS:
            e = bundled.encode([a, b])
            h = bundled.model(**e.inputs).last_hidden_state
            m = e.inputs["attention_mask"][..., None].float()
            embs.append((h * m).sum(1) / m.sum(1))
    cos = [torch.nn.functional.cosine_similarity(e[0], e[1], dim=0).item() for e in embs]
    assert res.baseline == pytest.approx(spearmanr(cos, GOLD).statistic, abs=1e-6)


def test_sweep_mlm_and_mean_mode(tokenizer):
    lens = random_lens("bert", tokenizer, head="AutoModelForMaskedLM")
    task = MlmTask(lens, SENTENCES * 2, batch_size=4)
    res = sweep(lens, task, "mean")
    assert not res.higher_is_better and res.baseline > 0
    assert head_means(lens, SENTENCES).shape == (2, 4, 16)
    assert res.heads[1, 2] == pytest.approx(
        _direct(lens, task, [Ablation(1, (2,), "mean")], means=_task_means(lens, task)), abs=1e-5
    )


def _task_means(lens, task) -> torch.Tensor:
    from mixlens.trace import run_traced

    total, count = 0, 0
    with torch.no_grad():
        for inputs in task.batches:
            tr = run_traced(lens.adapter, lens.model, inputs)
            m = tr.mask[:, None, None, :, None].float()
            total = total + (head_contexts(tr) * m).sum((0, 3))
            count += int(tr.mask.sum())
    return total / count


@pytest.mark.parametrize("family", ["bert", "gpt2", "albert"])
def test_sweep_accuracy_matches_direct(tokenizer, family):
    lens = random_lens(family, tokenizer, head="AutoModelForSequenceClassification", num_labels=2)
    labels = [0, 1, 1, 0, 1, 0]
    task = ClassificationTask(lens, (SENTENCES * 2)[:6], labels, batch_size=4)
    res = sweep(lens, task, "zero")
    with torch.no_grad():
        enc = lens.encode((SENTENCES * 2)[:6])
        pred = lens.model(**enc.inputs).logits.argmax(-1).tolist()
    assert res.baseline == pytest.approx(np.mean(np.array(pred) == labels))
    last = lens.adapter.n_layers - 1
    assert res.heads[last, 1] == pytest.approx(_direct(lens, task, [Ablation(last, (1,), "zero")]))
    assert res.layers[last] == pytest.approx(_direct(lens, task, [Ablation(last, None, "zero")]))


def test_cli_sweep_stsb(tmp_path, capsys):
    f = data_file("stsb", "dev.tsv")
    code, out, err = run_cli(["sweep", "-d", str(f), "--limit", "4", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    assert "baseline spearman" in out and (tmp_path / "sweep.png").is_file()
    assert len((tmp_path / "sweep.csv").read_text().splitlines()) == 1 + 72 + 6
    res = read_sweep_csv(tmp_path / "sweep.csv", "uniform", 4)  # back as printed by the command
    assert res.heads.shape == (6, 12) and res.layers.shape == (6,) and res.higher_is_better
    assert f"{res.baseline:.4f}" in out.split("baseline spearman")[1].splitlines()[0]
    printed = [line.split() for line in out.split("largest harms")[1].splitlines()[1:11]]
    assert [[name, f"{d:+.4f}"] for name, d in res.top_changes(10)] == printed


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--mode", "bogus"], "unknown ablation mode"),
        (["--metric", "bleu"], "unknown metric"),
        (["--score-column", "nope"], "no column 'nope'"),
    ],
)
def test_cli_sweep_errors(args, msg, capsys):
    f = data_file("stsb", "dev.tsv")
    code, _, err = run_cli(["sweep", "-d", str(f), "--limit", "2", *args], capsys)
    assert code == 2 and msg in err and "Traceback" not in err


def test_read_sweep_csv_rejects_other_tables(tmp_path):
    f = tmp_path / "other.csv"
    f.write_text("layer,head,bleu,delta\n0,0,0.5,0.1\n")
    with pytest.raises(MixlensError, match="not a sweep.csv"):
        read_sweep_csv(f, "uniform", 1)
