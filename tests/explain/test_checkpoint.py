"""Checkpoints of `mixlens evaluate` (#45 items 17–19): a resume continues only the same run (model, dtype, data,
options, methods), one run at a time writes into a folder, a finished evaluation of other data is never replaced,
and a tampered checkpoint is refused at start in one line."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from tests.conftest import run_cli

TEXTS = "a fine film\na dull movie\nso so\nwhat a ride\n"


@pytest.fixture
def run(tmp_path, monkeypatch):
    """(argv of a 4-text saliency evaluation into tmp_path/out in batches of 2, the folder)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "four.txt").write_text(TEXTS)
    out = tmp_path / "out"
    argv = ["evaluate", "--data", str(tmp_path / "four.txt"), "-o", str(out), "--method", "saliency"]
    return [*argv, "--batch-size", "2"], out


def interrupt_after_first_batch(argv, capsys, monkeypatch) -> dict:
    """Run `argv` with a Ctrl-C in its second batch: the checkpoint of 2 examples it leaves."""
    import mixlens.explain.scoring as scoring

    real, calls = scoring.perturbed_f, []

    def stop_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(scoring, "perturbed_f", stop_second)
    code, _, err = run_cli(argv, capsys)
    monkeypatch.setattr(scoring, "perturbed_f", real)
    assert code == 130, err
    out = Path(argv[argv.index("-o") + 1])
    return json.loads((out / "evaluation.json").read_text())


def one_line(code: int, err: str, *words: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]


def test_the_checkpoint_records_its_run(run, capsys, monkeypatch):
    argv, out = run
    doc = interrupt_after_first_batch(argv, capsys, monkeypatch)
    ident = doc["run"]
    assert ident["dtype"] == "float32" and ident["methods"] == ["saliency", "random"] and ident["seed"] == 0
    assert ident["removal"] == "delete" and ident["task"] == "faithfulness" and ident["model"] == doc["model"]
    assert len(ident["data"]["sha256"]) == 64


def test_resume_with_another_dtype_is_refused(run, capsys, monkeypatch):
    """#45 item 17: a rerun with --dtype bfloat16 resumed a float32 run (4 float32 + 12 bfloat16 examples)."""
    argv, out = run
    interrupt_after_first_batch(argv, capsys, monkeypatch)
    code, _, err = run_cli([*argv, "--dtype", "bfloat16"], capsys)
    one_line(code, err, "dtype", "'float32' → 'bfloat16'", "another --out")
    assert json.loads((out / "evaluation.json").read_text())["interrupted"]  # left as it was


def test_resume_of_a_changed_data_file_is_refused(run, capsys, monkeypatch, tmp_path):
    """#45 item 17: a changed file resumed with the old examples (a BLiMP file: the old targets)."""
    argv, out = run
    interrupt_after_first_batch(argv, capsys, monkeypatch)
    (tmp_path / "four.txt").write_text(TEXTS + "one more\n")  # the same first texts, other bytes
    code, _, err = run_cli(argv, capsys)
    one_line(code, err, "data", "changed")


def test_resume_with_other_options_is_refused(run, capsys, monkeypatch):
    argv, out = run
    interrupt_after_first_batch(argv, capsys, monkeypatch)
    code, _, err = run_cli([*argv, "--skip", "1"], capsys)
    one_line(code, err, "skip")
    code, _, err = run_cli([*argv, "--method", "attention"], capsys)
    one_line(code, err, "methods")


def test_the_same_run_resumes(run, capsys, monkeypatch):
    argv, out = run
    interrupt_after_first_batch(argv, capsys, monkeypatch)
    code, _, err = run_cli(argv, capsys)
    assert code == 0 and "(2 examples done)" in err, err
    assert "interrupted" not in json.loads((out / "evaluation.json").read_text())


def test_a_finished_evaluation_of_other_data_is_not_replaced(run, capsys, tmp_path):
    """#45 item 18: a finished evaluation of other data was replaced without a word; the same run is redone."""
    argv, out = run
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    before = (out / "evaluation.json").read_bytes()
    (tmp_path / "other.txt").write_text("quite different\nnot the same\n")
    other = list(argv)
    other[other.index("--data") + 1] = str(tmp_path / "other.txt")
    code, _, err = run_cli(other, capsys)
    one_line(code, err, "finished evaluation of other data", "another --out")
    assert (out / "evaluation.json").read_bytes() == before
    code, _, err = run_cli(argv, capsys)  # the same data: computed again
    assert code == 0, err


def _hold(out: str, ready, release) -> None:
    from mixlens.explain.checkpoint import locked

    with locked(Path(out)):
        ready.set()
        release.wait(30)


def test_a_second_run_into_the_same_folder_is_refused(run, capsys):
    """#45 item 18: two concurrent runs into one --out both exited 0 and one's examples were lost."""
    argv, out = run
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(out), ready, release))
    holder.start()
    try:
        assert ready.wait(300)  # a spawned interpreter importing torch: slow on a loaded machine
        code, _, err = run_cli(argv, capsys)
        one_line(code, err, "is in use by another mixlens evaluate run", f"pid {holder.pid}")
    finally:
        release.set()
        holder.join(30)
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err


def tamper(doc: dict, what: str) -> None:
    e = doc["examples"][0]
    if what == "notes":
        doc["notes"] = [1, 2]
    elif what == "skipped":
        doc["skipped"] = []
    elif what == "scores":
        e["scores"]["saliency"] = e["scores"]["saliency"][:-1]
    elif what == "f":
        e["f"] = "abc"
    elif what == "removed":
        e["f_removed"]["saliency"] = [0.1]
    elif what == "ids":
        e["ids"] = ["x"] * len(e["ids"])
    elif what == "examples":
        doc["examples"] = {"a": 1}
    elif what == "interrupted":
        doc["interrupted"] = {"examples": "two"}
    elif what == "run":
        doc["run"] = [1]
    elif what == "special":
        e["special"] = e["special"][:-1]


@pytest.mark.parametrize(
    "what, where",
    [
        ("notes", "notes"),
        ("skipped", "skipped"),
        ("scores", "examples[0].scores.saliency"),
        ("f", "examples[0].f"),
        ("removed", "examples[0].f_removed.saliency"),
        ("ids", "examples[0].ids"),
        ("examples", "examples"),
        ("interrupted", "interrupted"),
        ("run", "run"),
        ("special", "examples[0].special"),
    ],
)
def test_a_tampered_checkpoint_is_refused_at_start(what, where, run, capsys, monkeypatch):
    """#45 item 19: a tampered checkpoint gave a traceback at start, or was accepted and crashed after the new
    examples were computed (they were lost). It is checked before the model loads."""
    argv, out = run
    doc = interrupt_after_first_batch(argv, capsys, monkeypatch)
    tamper(doc, what)
    (out / "evaluation.json").write_text(json.dumps(doc))
    import mixlens.lens

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mixlens.lens, "load", no_load)
    code, _, err = run_cli(argv, capsys)
    one_line(code, err, "cannot resume", where)
