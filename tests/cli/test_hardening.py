"""Hardening of the CLI (issue #15): one-line errors for hostile input and failing filesystems, refused random
heads, output that shows what was asked, progress only on a terminal, consistent input checks."""

from __future__ import annotations

import errno
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import mixlens
from mixlens.errors import MixlensError
from tests.conftest import SENTENCES, data_file, run_cli

SENTENCE = "The keys to the cabinet are on the table."


def one_line_error(code: int, err: str) -> bool:
    return code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: the error under test must come before the weights load."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mixlens.lens.load", refuse)


# ------------------------------------------------------------------------------------------ 1. no traceback


@pytest.mark.parametrize(
    "argv, named",
    [
        (["analyze", "abc \udcff\udcfe def"], "argument 2"),
        (["analyze", "hi", "--out", "r\udcff.json"], "the value of --out"),
        (["corpus", "-d", "x\udcfe.tsv", "-o", "o"], "the value of -d"),
    ],
)
def test_invalid_utf8_in_argv(argv, named, capsys, no_model):
    code, _, err = run_cli(argv, capsys)
    assert one_line_error(code, err) and named in err and "not valid UTF-8" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", "hi", "--out", "{d}"],
        ["analyze", "hi", "--format", "html", "--out", "{d}"],
        ["analyze", "hi", "--format", "json", "--out", "{d}"],
        ["report", "hi", "--out", "{d}.html"],
        ["plot", "hi", "--out", "{d}.png"],
        ["compare-local-global", "{data}", "--out", "{d}"],
    ],
)
def test_out_is_a_directory(argv, tmp_path, capsys, no_model):
    d = tmp_path / "somedir"
    for suffix in ("", ".html", ".png"):
        (tmp_path / f"somedir{suffix}").mkdir()
    data = tmp_path / "t.txt"
    data.write_text("one sentence\n")
    code, _, err = run_cli([a.format(d=d, data=data) for a in argv], capsys)
    assert one_line_error(code, err) and "is a directory" in err and str(d) in err


@pytest.mark.parametrize("eno, reason", [(errno.EROFS, "Read-only file system"), (errno.ENOSPC, "No space left")])
def test_atomic_write_failing_filesystem(eno, reason, tmp_path, monkeypatch):
    from mixlens import atomic as files

    def fail(*args, **kwargs):
        raise OSError(eno, os.strerror(eno))

    if eno == errno.EROFS:
        monkeypatch.setattr(files.tempfile, "mkstemp", fail)
    else:  # the temp file is created, the write fails: it must not stay behind
        monkeypatch.setattr(files.os, "replace", fail)
    target = tmp_path / "out.json"
    with pytest.raises(MixlensError, match=f"cannot write '{target}': {reason}"):
        files.atomic_write(target, b"{}")
    assert list(tmp_path.iterdir()) == []


def test_analyze_on_read_only_filesystem(tmp_path, monkeypatch, capsys):
    from mixlens import atomic as files

    def fail(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(files.tempfile, "mkstemp", fail)
    code, _, err = run_cli(["analyze", "hi", "--out", str(tmp_path / "a.json")], capsys)
    assert one_line_error(code, err) and "a.json" in err and "Read-only file system" in err


def test_syntax_invalid_utf8(tmp_path, capsys, no_model):
    f = tmp_path / "bad.conllu"
    f.write_bytes(b"# text = x\n1\tgo\tgo\tVERB\t_\t_\t0\troot\t_\t_\n\n1\tcaf\xe9\t_\tNOUN\t_\t_\t0\troot\t_\t_\n")
    code, _, err = run_cli(["syntax", "-d", str(f)], capsys)
    assert one_line_error(code, err) and "line 4 is not valid UTF-8" in err


def corrupt_parquet(path) -> None:
    """A Parquet file whose footer is valid but whose data pages are garbage."""
    pq.write_table(pa.table({"sentence": [f"sentence number {k}" for k in range(200)]}), path, compression="snappy")
    raw = bytearray(path.read_bytes())
    raw[4:400] = b"\xff" * 396  # the first page header and data; the footer at the end stays intact
    path.write_bytes(bytes(raw))
    assert pq.ParquetFile(path).metadata.num_rows == 200  # the footer still reads


@pytest.mark.parametrize(
    "command, message",
    [
        ("heads", "the Parquet data cannot be read"),
        ("patterns", "the Parquet data cannot be read"),
        ("syntax", "is not valid UTF-8"),
    ],  # syntax reads CoNLL-U only: binary input is refused as such
)
def test_parquet_with_corrupt_data_pages(command, message, tmp_path, capsys, no_model):
    f = tmp_path / "bad.parquet"
    corrupt_parquet(f)
    code, _, err = run_cli([command, "-d", str(f), "-o", str(tmp_path / "o")], capsys)
    assert one_line_error(code, err) and message in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------ 2. random heads


def test_load_refuses_random_classifier_head():
    with pytest.raises(MixlensError, match=r"classifier\.bias, classifier\.weight .*--allow-random-head"):
        mixlens.load(head="sequence-classification")
    lens = mixlens.load(head="sequence-classification", allow_random_head=True)  # explicit opt-in
    assert type(lens.model).__name__ == "BertForSequenceClassification"
    assert type(mixlens.load().model).__name__ == "BertModel"  # a complete checkpoint loads as before


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", "A fine film.", "--method", "saliency", "--model-head", "sequence-classification"],
        ["analyze", "A fine film.", "--method", "saliency", "--head", "sequence-classification"],
        ["saliency", "A fine film.", "--model-head", "sequence-classification"],
        ["report", "A fine film.", "--model-head", "masked-lm", "--out", "{tmp}/r.html"],
    ],
)
def test_cli_refuses_random_head(argv, tmp_path, capsys):
    code, _, err = run_cli([a.format(tmp=tmp_path) for a in argv], capsys)
    err_lines = [ln for ln in err.splitlines() if not ln.startswith("warning: --head is deprecated")]
    assert one_line_error(code, "\n".join(err_lines)) and "newly initialised" in err and "--allow-random-head" in err
    assert not (tmp_path / "r.html").exists()


# ------------------------------------------------------------------------------------------ 3. output


def test_analyze_map_method_prints_top_sources(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["analyze", SENTENCE, "--method", "alti"], capsys)
    assert code == 0, err
    assert "alti: top 3 sources of each token (layer 5)" in out and "cabinet" in out
    assert "Context-mixing ratio" not in out  # alti is not the norm family
    assert "wrote alti (token × token maps per layer)" in err


def test_analyze_vector_method_says_what_was_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [
        "analyze",
        "A fine film.",
        "--method",
        "saliency",
        "--method",
        "norm",
        "--model-head",
        "sequence-classification",
        "--allow-random-head",
    ]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "saliency:" in out and "film" in out and "Context-mixing ratio" in out
    assert "saliency (a score per token)" in err and "matrices" not in err


@pytest.mark.parametrize("width", [80, 120])
def test_wide_tables_fit(width, monkeypatch, capsys, tmp_path):
    import pandas as pd

    from mixlens.stats.heads import STATISTICS
    from mixlens.viz.terminal import print_frame

    monkeypatch.setenv("COLUMNS", str(width))
    cols = ["layer", *[f"{v}_{s}" for v in ("attn", "norm") for s in STATISTICS]]
    print_frame(pd.DataFrame([[k, *[0.123456] * (len(cols) - 1)] for k in range(6)], columns=cols), "summary")
    err = capsys.readouterr().err
    assert "…" not in err and max(len(ln) for ln in err.splitlines()) <= width
    for c in cols:
        assert c in err  # every header whole
    code, out, _ = run_cli(["analyze", SENTENCE, "--format", "table", "--out", str(tmp_path / "a.json")], capsys)
    assert code == 0 and "ResLN-N" in out and max(len(ln) for ln in out.splitlines()) <= width


def test_heads_writes_no_figures_unless_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "t.txt"
    f.write_text("\n".join(SENTENCES[:3]) + "\n")
    code, out, err = run_cli(["heads", "-d", str(f), "-f", "csv", "--no-cluster"], capsys)
    assert code == 0, err
    assert not (tmp_path / "mixlens-heads").exists() and out.startswith("layer,head")
    code, _, err = run_cli(["patterns", "-d", str(f), "-o", "p"], capsys)
    assert code == 0 and not (tmp_path / "p" / "patterns.png").exists() and "p/patterns.parquet" in err
    code, _, err = run_cli(["patterns", "-d", str(f), "-o", "p", "--figures"], capsys)
    assert code == 0 and (tmp_path / "p" / "patterns.png").is_file() and "p/patterns.png" in err


def test_report_opens_on_the_decomposition_and_draws_vector_methods(bundled):
    from mixlens.viz.html import build_payload, render_report

    res = bundled.analyze([SENTENCE], ["attention", "norm", "norm_resln"])
    payload = build_payload(res)
    assert payload["methods"][payload["start_method"]]["name"] == "norm_resln"
    cls = mixlens.load(head="sequence-classification", allow_random_head=True)
    res = cls.analyze(["A fine film."], ["attention", "saliency", "decompx_classes"])
    payload = build_payload(res)
    assert [s["name"] for s in payload["scores"]] == ["saliency", "decompx_classes"]
    assert not any("JSON" in n for n in payload["notes"])
    page = render_report(res)
    assert "Per-token scores (highlighted text)" in page and 'title="' in page and ">film</span>" in page


def test_plot_draws_a_vector_method_as_text(tmp_path, capsys):
    f = tmp_path / "s.png"
    argv = [
        "plot",
        "A fine film.",
        "--method",
        "decompx_classes",
        "--model-head",
        "sequence-classification",
        "--allow-random-head",
        "--out",
        str(f),
    ]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert f.read_bytes().startswith(b"\x89PNG") and "highlighted-text figure of decompx_classes" in err


def test_corpus_ctrl_c_says_how_to_resume(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("mixlens.corpus.runner.run_corpus", interrupted)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my data.tsv").write_text("sentence\nhello there\n")
    argv = ["corpus", "-d", "my data.tsv", "-o", str(tmp_path / "run"), "--method", "norm"]
    code, _, err = run_cli(argv, capsys)
    assert code == 130
    assert f"mixlens corpus -d 'my data.tsv' -o {tmp_path / 'run'} --method norm" in err and "Resume" in err


def test_sigterm_stops_a_command_as_ctrl_c_does(tmp_path, monkeypatch, capsys):
    """`kill` (SIGTERM: a scheduler stopping the job, or a job whose Ctrl-C a script's background ignores) takes the
    Ctrl-C path: the same message and exit code 130, resumable; the previous handler is back afterwards."""
    import os
    import signal
    import time

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this
        raise AssertionError("SIGTERM did not stop the command")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr("mixlens.corpus.runner.run_corpus", terminated)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.tsv").write_text("sentence\nhello there\n")
    code, _, err = run_cli(["corpus", "-d", "data.tsv", "-o", str(tmp_path / "run"), "--method", "norm"], capsys)
    assert code == 130 and "Resume" in err
    assert signal.getsignal(signal.SIGTERM) is before


# ------------------------------------------------------------------------------------------ 4. progress


def test_progress_only_on_a_terminal(monkeypatch, capsys):
    argv = ["analyze", "hi", "--method", "value_zeroing", "--format", "json"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and json.loads(out) and "value_zeroing" not in err  # piped: no progress at all
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and json.loads(out)  # never into the JSON
    assert "value_zeroing" in err


def test_plain_progress_lines_for_a_log_file(capsys):
    """stderr not a terminal (nohup, a scheduler's log): no bar, but a line per `every` seconds with the count,
    the elapsed time and the time left; nothing at all for a job shorter than `every`."""
    from mixlens.commands.output import plain_progress

    now = [100.0]
    step = plain_progress(40, "evaluate", every=60.0, clock=lambda: now[0])
    now[0] += 30
    step(5)
    assert capsys.readouterr().err == ""
    now[0] += 50  # 80 s in, 10 of 40 done: 240 s left
    step(5)
    assert capsys.readouterr().err == "evaluate: 10/40 (25.0 %), 0:01:20 elapsed, about 0:04:00 left\n"
    now[0] += 10
    step(0.5)
    assert capsys.readouterr().err == ""  # not again before another minute
    resumed = plain_progress(100, "evaluate", every=60.0, clock=lambda: now[0], done=80)
    now[0] += 60  # 5 more in its first minute: the 15 left take 3 minutes at its own pace (not 11 s at 85 a minute)
    resumed(5)
    assert capsys.readouterr().err == "evaluate: 85/100 (85.0 %), 0:01:00 elapsed, about 0:03:00 left\n"
    spin = plain_progress(None, "hidden states", every=1.0, clock=lambda: now[0])
    now[0] += 3725
    spin(2)
    assert capsys.readouterr().err == "hidden states: 2 done, 1:02:05 elapsed\n"


# ------------------------------------------------------------------------------------------ 5. input handling


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", "hi"],
        ["corpus", "-d", "x.tsv", "-o", "o"],
        ["report", "hi"],
        ["plot", "hi", "--out", "f.png"],
        ["compare-local-global", "x.tsv"],
    ],
)
def test_max_length_checked_alike(argv, capsys, no_model):
    code, _, err = run_cli([*argv, "--max-length", "0"], capsys)
    assert code == 2 and "Invalid value for '--max-length': Input should be greater than or equal to 1" in err


@pytest.mark.parametrize("command", ["heads", "patterns", "compare-local-global", "corpus"])
def test_header_only_file_fails_before_the_model(command, tmp_path, capsys, no_model):
    f = tmp_path / "h.tsv"
    f.write_text("sentence\tlabel\n")
    argv = [command, str(f)] if command == "compare-local-global" else [command, "-d", str(f)]
    code, _, err = run_cli([*argv, "-o", str(tmp_path / "o")], capsys)
    assert one_line_error(code, err) and "h.tsv has no rows" in err
    assert not (tmp_path / "o").exists()


def test_model_free_errors_come_first(capsys, no_model):
    code, _, err = run_cli(["analyze", " ".join(["word"] * 40), "--method", "attention_flow"], capsys)
    assert one_line_error(code, err) and "attention_flow is limited to 32 tokens" in err
    code, _, err = run_cli(["analyze", "A fine film.", "--method", "decompx_classes"], capsys)
    assert one_line_error(code, err) and "decompx needs a sequence-classification model" in err


def test_shared_syntax_file_still_reads():
    from mixlens.stats.syntax import read_conllu

    sents = list(read_conllu(data_file("ud_ewt", "en_ewt-ud-dev.conllu"), 5))
    assert len(sents) == 5 and all(s.words for s in sents)


def test_a_library_warning_is_one_line_without_its_source_path(monkeypatch, capsys):
    """#45 item 24: numpy / scipy warnings reached stderr with their source file and line (and the code line)."""
    import warnings

    import numpy as np

    import mixlens.lens

    real = mixlens.lens.Lens.analyze

    def noisy(self, *args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            np.log(np.zeros(1))  # numpy's RuntimeWarning: divide by zero encountered in log
        return real(self, *args, **kwargs)

    monkeypatch.setattr(mixlens.lens.Lens, "analyze", noisy)
    code, _, err = run_cli(["analyze", "A fine film.", "--method", "attention"], capsys)
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if "divide by zero" in ln]
    assert lines == ["mixlens: warning: divide by zero encountered in log (RuntimeWarning)"], err
    assert ".py" not in "".join(lines)
