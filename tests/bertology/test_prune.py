"""Head sets (`parse_heads`, `disabled`), pruning chosen on a selection split and confirmed on held-out data, and
physical removal of heads (mixlens.bertology.prune)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mixlens.bertology.prune import (
    _statistic,
    ablations_for,
    load_pruned,
    n_parameters,
    paired_bootstrap,
    prune,
    prune_model,
    save_pruned,
    split_indices,
    task_outputs,
)
from mixlens.bertology.sweep import sweep
from mixlens.bertology.tasks import ClassificationTask, StsTask
from mixlens.errors import MixlensError
from mixlens.interventions import Ablation, ablated_trace, disabled, format_heads, parse_heads
from mixlens.trace import hooked
from tests.conftest import SENTENCES, data_file, random_lens, random_model, run_cli

WORDS = "the a cat dog man woman runs sleeps eats quickly red green house park table book sees likes".split()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(4, 10))) for _ in range(n)]


def test_parse_and_format_heads(bundled):
    abl = parse_heads("L5H8, l0h9,L0H1,L3", bundled)
    assert abl == [Ablation(0, (1, 9), "zero"), Ablation(3, None, "zero"), Ablation(5, (8,), "zero")]
    assert parse_heads("", bundled) == []
    assert format_heads([(5, 8), (0, 9)]) == "L5H8,L0H9"
    for spec, msg in [
        ("L5H12", "unknown head in 'L5H12': the model has heads H0..H11"),
        ("L6H0", "unknown layer in 'L6H0': the model has layers L0..L5"),
        ("5.8", "bad head '5.8'"),
    ]:
        with pytest.raises(MixlensError, match=msg.replace(".", r"\.")):
            parse_heads(spec, bundled)


def test_disabled_applies_to_every_trace_and_only_inside(bundled):
    enc = bundled.encode(SENTENCES)
    want = ablated_trace(bundled, enc, [Ablation(2, (4, 7), "zero"), Ablation(4, None, "zero")])
    base = bundled.trace(enc)
    with disabled(bundled, "L2H4,L2H7,L4"):
        got = bundled.trace(enc)
    after = bundled.trace(enc)
    for la in range(6):
        torch.testing.assert_close(got.layers[la].out, want.layers[la].out, atol=0, rtol=0)
        torch.testing.assert_close(after.layers[la].out, base.layers[la].out, atol=0, rtol=0)
    assert (got.layers[5].out - base.layers[5].out).abs().max() > 1e-2
    with pytest.raises(MixlensError, match="takes mode zero"), disabled(bundled, [Ablation(0, (1,), "uniform")]):
        pass


def test_analyses_under_disabled_stay_exact(bundled):
    """Decompositions of a disabled model reconstruct its real outputs (the reconstruction check runs inside
    analyze) and give the disabled heads no contribution."""
    with disabled(bundled, "L1H3,L4"):
        res = bundled.analyze(SENTENCES, ["norm"], heads=True)
    norm = res["norm"].values  # [batch, layer, head, target, source]
    assert np.abs(norm[:, 1, 3]).max() == 0 and np.abs(norm[:, 4]).max() == 0
    assert np.abs(norm[:, 1, 2]).max() > 0
    assert res.reconstruction_error.max() < 1e-4


def test_sweep_under_disabled_starts_from_the_disabled_model(tokenizer):
    lens = random_lens("bert", tokenizer, head="AutoModelForSequenceClassification", num_labels=2)
    texts = _texts(12)
    task = ClassificationTask(lens, texts, [i % 2 for i in range(12)], batch_size=5)
    with disabled(lens, "L0H1"):
        res = sweep(lens, task, "zero")
    direct = task.score(task_outputs(lens, task, [Ablation(0, (1,), "zero")]))
    assert res.baseline == pytest.approx(direct)
    assert res.delta_heads[0, 1] == 0  # disabling it again changes nothing
    both = task.score(task_outputs(lens, task, [Ablation(0, (1,), "zero"), Ablation(1, (3,), "zero")]))
    assert res.heads[1, 3] == pytest.approx(both)


def _planted(tokenizer):
    """A random BERT classifier whose head L1H2 is made harmful: the gold labels are the predictions of the model
    without it, and its output projection is scaled up so that it flips many of them."""
    lens = random_lens("bert", tokenizer, head="AutoModelForSequenceClassification", num_labels=2, seed=3)
    lay = lens.adapter.layers[1]
    d_h = lay.d_head
    dense = lens.model.bert.encoder.layer[1].attention.output.dense
    texts = _texts(60, seed=1)
    task = ClassificationTask(lens, texts, [0] * 60, batch_size=16)
    clean = torch.cat(task_outputs(lens, task, [Ablation(1, (2,), "zero")]))  # correctness vs all-zero labels
    with torch.no_grad():
        dense.weight[:, 2 * d_h : 3 * d_h] *= 40
    gold = [0 if c else 1 for c in clean.tolist()]  # rows of task.batches are in sorted order
    order = np.argsort([len(ids) for ids in tokenizer(texts)["input_ids"]], kind="stable")
    labels = [0] * 60
    for row, i in enumerate(order):
        labels[i] = gold[row]
    return lens, texts, labels


def test_prune_finds_a_planted_harmful_head_and_confirms_it(tokenizer):
    lens, texts, labels = _planted(tokenizer)
    sel, held = split_indices(len(texts), 0.5, seed=0)
    mk = lambda idx: ClassificationTask(lens, [texts[i] for i in idx], [labels[i] for i in idx], batch_size=16)  # noqa: E731
    selection, heldout = mk(sel), mk(held)
    res = prune(lens, selection, heldout, n_resamples=1000, seed=0)
    assert res.heads == [(1, 2)] and res.spec == "L1H2"
    assert res.selection_score == 1.0 and res.heldout_score == 1.0
    assert res.heldout_baseline < 0.9 and res.ci[0] > 0 and res.confirmed
    assert res.head_gains[1, 2] == res.head_gains.max()
    again = prune(lens, selection, heldout, n_resamples=1000, seed=0)
    assert again.ci == res.ci  # seeded


def test_bootstrap_statistic_equals_scipy_and_the_interval_is_paired(bundled):
    from scipy.stats import spearmanr

    pairs = [(a, b) for a, b in zip(_texts(12, 1), _texts(12, 2), strict=True)]
    gold = list(np.linspace(0, 5, 12))
    task = StsTask(bundled, pairs, gold, batch_size=8)
    base = task_outputs(bundled, task)
    from mixlens.bertology.prune import _example_values

    cos = _example_values(task, base)
    idx = np.random.default_rng(0).integers(0, 12, size=(5, 12))
    want = [spearmanr(cos[i], np.asarray(gold)[i]).statistic for i in idx]
    np.testing.assert_allclose(_statistic(task, cos, idx), want, atol=1e-12)
    assert _statistic(task, cos, np.arange(12)[None])[0] == pytest.approx(task.score(base), abs=1e-12)
    assert paired_bootstrap(task, base, base) == (0.0, 0.0)  # the same model: every paired difference is 0


def test_bootstrap_draws_its_resamples_in_chunks(bundled, monkeypatch):
    """#45 item 21: the resamples' indices were drawn at once ([R, m]: memory grew with --resamples); they come in
    chunks of at most `RESAMPLE_CELLS` indices, the same interval as one draw where one chunk holds them all, and
    more than `MAX_RESAMPLES` is refused."""
    from mixlens.bertology import prune as P

    pairs = [(a, b) for a, b in zip(_texts(12, 1), _texts(12, 2), strict=True)]
    task = StsTask(bundled, pairs, list(np.linspace(0, 5, 12)), batch_size=8)
    base = task_outputs(bundled, task)
    new = [b + 0.01 * torch.randn(b.shape, generator=torch.Generator().manual_seed(k)) for k, b in enumerate(base)]
    whole = paired_bootstrap(task, base, new, n_resamples=1000, seed=3)
    sizes: list[int] = []
    statistic = P._statistic
    monkeypatch.setattr(P, "_statistic", lambda t, v, idx: (sizes.append(idx.size), statistic(t, v, idx))[1])
    monkeypatch.setattr(P, "RESAMPLE_CELLS", 12 * 64)
    chunked = paired_bootstrap(task, base, new, n_resamples=1000, seed=3)
    assert max(sizes) == 12 * 64 and sum(sizes) == 2 * 12 * 1000
    assert chunked == pytest.approx(whole, abs=0.05)  # another split of the same seeded stream: close, not equal
    with pytest.raises(MixlensError, match="n_resamples must be an integer in"):
        paired_bootstrap(task, base, new, n_resamples=P.MAX_RESAMPLES + 1)


def test_split_too_small_is_one_line():
    with pytest.raises(MixlensError, match="too small to confirm a pruning"):
        split_indices(15, 0.5)
    sel, held = split_indices(40, 0.25, seed=1)
    assert len(held) == 10 and len(sel) == 30 and not set(sel) & set(held)


@pytest.mark.parametrize("family", ["bert", "roberta", "electra"])
def test_physical_pruning_equals_zero_ablation(tokenizer, tmp_path, family):
    lens = random_lens(family, tokenizer)
    heads = [(0, 1), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]  # layer 1 loses every head
    enc = lens.encode(SENTENCES)
    with torch.no_grad(), disabled(lens, ablations_for(heads)), hooked(lens.adapter):
        want = lens.model(**enc.inputs).last_hidden_state
    pruned = save_pruned(lens, heads, tmp_path / "m")
    loaded = load_pruned(tmp_path / "m")
    with torch.no_grad():
        got = pruned(**enc.inputs).last_hidden_state
        got_loaded = loaded(**enc.inputs).last_hidden_state
        orig = lens.model(**enc.inputs).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_loaded, got, atol=0, rtol=0)
    assert (orig - want).abs().max() > 1e-3  # the heads did something
    d, d_h = 64, 16
    assert n_parameters(lens.model) - n_parameters(pruned) == len(heads) * (4 * d * d_h + 3 * d_h)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["mixlens_pruned_heads"] == {"0": [1, 3], "1": [0, 1, 2, 3]}


def test_physical_pruning_refuses_other_families(tokenizer):
    lens = random_lens("gpt2", tokenizer)
    with pytest.raises(MixlensError, match="physical pruning supports"):
        prune_model(lens.model, {0: [1]})


def test_cli_prune_stsb(tmp_path, capsys):
    f = data_file("stsb", "dev.tsv")
    code, out, err = run_cli(
        [
            "prune",
            "-d",
            str(f),
            "--limit",
            "24",
            "--max-heads",
            "2",
            "--resamples",
            "200",
            "--disable",
            "L5H8",
            "-o",
            str(tmp_path),
        ],
        capsys,
    )
    assert code == 0, err
    summary = json.loads((tmp_path / "prune.json").read_text())
    assert summary["n_selection"] == 12 and summary["n_heldout"] == 12 and summary["disabled_before"] == "L5H8"
    assert "held-out split (12 examples)" in out
    assert ("--disable L" in out) == bool(summary["heads"])
    assert len(summary["heads"].split(",")) <= 2


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--disable", "L5H12"], "unknown head in 'L5H12'"),
        (["--limit", "12"], "too small to confirm a pruning"),
        (["--held-out", "1.5"], "between 0 and 1"),
        (["--resamples", "100000000"], "less than or equal to 100000"),  # #45 item 21: [1e8, m] indices at once
    ],
)
def test_cli_prune_errors(args, msg, capsys):
    f = data_file("stsb", "dev.tsv")
    code, _, err = run_cli(["prune", "-d", str(f), "--limit", "40", *args], capsys)
    assert code == 2 and msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_sweep_disable_unknown_layer(capsys):
    f = data_file("stsb", "dev.tsv")
    code, _, err = run_cli(["sweep", "-d", str(f), "--limit", "2", "--disable", "L9H0"], capsys)
    assert code == 2 and "unknown layer in 'L9H0'" in err


# --- issue #32: prune --save on a classifier, data loss, failing filesystems, gold labels ---------------------------


@pytest.fixture
def classifier(tmp_path, tokenizer):
    """A saved 2-class random BERT classifier (model folder) and a 24-row sentence/label TSV."""
    model = random_model("bert", tokenizer, "AutoModelForSequenceClassification")
    model.save_pretrained(tmp_path / "clf")
    tokenizer.save_pretrained(tmp_path / "clf")
    rows = [(t, k % 2) for k, t in enumerate(_texts(24, 3))]
    data = tmp_path / "d.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    return tmp_path / "clf", data


def _prune_argv(model, data, out, *extra):
    return [
        "prune",
        "--model",
        str(model),
        "-d",
        str(data),
        "--max-heads",
        "1",
        "--resamples",
        "100",
        "-o",
        str(out),
        *extra,
    ]


def _tree(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_cli_prune_save_classifier_loads_in_mixlens_and_transformers(classifier, tmp_path, capsys):
    """Item 11 (IndexError: mask [20, n] vs logits [20, 2]) and C (a saved checkpoint did not load under --model)."""
    import transformers

    import mixlens

    model_dir, data = classifier
    save = tmp_path / "pruned"
    code, out, err = run_cli(
        _prune_argv(model_dir, data, tmp_path / "o", "--disable", "L0H0", "--save", str(save)), capsys
    )
    assert code == 0, err
    assert "pruned forward" in out and "vs original" in out
    summary = json.loads((tmp_path / "o" / "prune.json").read_text())
    assert summary["saved"]["path"] == str(save)
    heads = parse_heads(",".join(filter(None, ["L0H0", summary["heads"]])), mixlens.load(model_dir))
    enc = mixlens.load(model_dir).encode(SENTENCES)
    orig = mixlens.load(model_dir)
    with torch.no_grad(), disabled(orig, heads), hooked(orig.adapter):
        want = orig.model(**enc.inputs).logits
    lens = mixlens.load(save)  # the CLI's own loader
    plain = transformers.AutoModelForSequenceClassification.from_pretrained(save).eval()
    with torch.no_grad():
        for m in (lens.model, plain, load_pruned(save)):
            torch.testing.assert_close(m(**enc.inputs).logits, want, atol=1e-5, rtol=1e-5)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    code, _, err = run_cli(["analyze", "a film", "--model", str(save)], capsys)
    assert code == 0, err


def test_cli_prune_save_refuses_the_source_folder_and_a_file(classifier, tmp_path, capsys):
    model_dir, data = classifier
    before = _tree(model_dir)
    (tmp_path / "afile").write_text("x\n")
    for target, msg in (
        (model_dir, "is the --model folder"),
        (tmp_path / "afile", "is a file"),
        (tmp_path, "non-empty directory that holds no pruned checkpoint"),
    ):
        code, out, err = run_cli(_prune_argv(model_dir, data, tmp_path / "o", "--save", str(target)), capsys)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "saved" not in out and not (tmp_path / "o").exists()
    assert _tree(model_dir) == before and (tmp_path / "afile").read_text() == "x\n"


def test_cli_prune_save_on_a_failing_filesystem_is_one_line(classifier, tmp_path, capsys, monkeypatch):
    """Item 15: a read-only or full filesystem while saving → one line, exit 2, no checkpoint, no tables."""
    import errno

    import transformers

    model_dir, data = classifier

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    code, out, err = run_cli(
        _prune_argv(model_dir, data, tmp_path / "o", "--disable", "L0H0", "--save", str(tmp_path / "pruned")), capsys
    )
    assert code == 2 and "No space left on device" in err and len(err.strip().splitlines()) == 1, err
    assert "saved" not in out and not (tmp_path / "o").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clf", "d.tsv"]  # no checkpoint, no temporary folder

    (tmp_path / "outs").mkdir()  # -o is writable; --save's folder (tmp_path) is read-only (the tests may run as root)
    monkeypatch.setattr("os.access", lambda p, *a, **k: str(p) != str(tmp_path))
    code, _, err = run_cli(
        _prune_argv(model_dir, data, tmp_path / "outs" / "o", "--save", str(tmp_path / "pruned")), capsys
    )
    assert code == 2 and "is not a writable directory" in err and len(err.strip().splitlines()) == 1, err


def test_save_pruned_replaces_an_earlier_pruned_checkpoint_only(tmp_path, tokenizer):
    lens = random_lens("bert", tokenizer)
    save_pruned(lens, [(0, 1)], tmp_path / "m")
    save_pruned(lens, [(1, 2)], tmp_path / "m")  # an earlier pruned checkpoint is replaced
    assert json.loads((tmp_path / "m" / "config.json").read_text())["mixlens_pruned_heads"] == {"1": [2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(MixlensError, match="holds no pruned checkpoint"):
        save_pruned(lens, [(0, 1)], tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_cli_prune_refuses_a_gold_label_the_model_does_not_have(classifier, tmp_path, capsys):
    model_dir, data = classifier
    data.write_text(data.read_text().replace("\t1\n", "\t7\n", 1))
    code, _, err = run_cli(_prune_argv(model_dir, data, tmp_path / "o"), capsys)
    assert code == 2 and "gold label 7" in err and "2 classes" in err and len(err.strip().splitlines()) == 1, err


def test_pruning_a_pruned_checkpoint_keeps_the_earlier_heads(tmp_path, tokenizer):
    import mixlens

    lens = random_lens("bert", tokenizer)
    save_pruned(lens, [(0, 1)], tmp_path / "a")
    again = save_pruned(mixlens.load(tmp_path / "a"), [(1, 2)], tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["mixlens_pruned_heads"] == {"0": [1], "1": [2]}
    assert (
        n_parameters(load_pruned(tmp_path / "b"))
        == n_parameters(again)
        == n_parameters(save_pruned(lens, [(0, 1), (1, 2)], tmp_path / "c"))
    )


def test_cli_prune_save_sst2_classifier(classifier, tmp_path, capsys):
    """Item 11 as reported: a 2-class classifier on the SST-2 dev TSV, --max-heads 1 --disable L0H0 --save DIR."""
    f = data_file("sst2", "dev.tsv")
    model_dir, _ = classifier
    code, out, err = run_cli(
        _prune_argv(
            model_dir, f, tmp_path / "o", "--limit", "40", "--disable", "L0H0", "--save", str(tmp_path / "pruned")
        ),
        capsys,
    )
    assert code == 0 and "Traceback" not in err, err
    assert "pruned forward" in out and (tmp_path / "pruned" / "model.safetensors").is_file()


def test_cli_prune_on_a_nan_metric_writes_a_null_interval(classifier, tmp_path, capsys, monkeypatch):
    """#45 item 24: a metric that is not a number (e.g. a correlation over constant scores) wrote ci95 [0.0, 0.0],
    an interval it never computed; it is null, with a note."""
    from mixlens.bertology import tasks

    monkeypatch.setattr(tasks.ClassificationTask, "score", lambda self, parts: float("nan"))
    model_dir, data = classifier
    code, out, err = run_cli(_prune_argv(model_dir, data, tmp_path / "o"), capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / "o" / "prune.json").read_text())
    assert not doc["heads"], doc["heads"]
    assert doc["ci95"] == [None, None], doc["ci95"]
