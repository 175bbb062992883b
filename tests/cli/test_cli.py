"""`mixlens analyze` through the real CLI: JSON contract, table, and every error case."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.conftest import run_cli

SENTENCE = "The keys to the cabinet are on the table."
HEAVY = ("torch", "transformers", "numpy", "pandas", "matplotlib", "pyarrow", "scipy", "numba", "rich", "safetensors")


@pytest.mark.slow  # starts fresh processes
def test_help_loads_no_heavy_module():
    """Start-up: in a fresh interpreter, the CLI module and every `--help` load none of the heavy libraries."""
    code = textwrap.dedent(f"""
        import sys
        import mixlens.cli
        from mixlens.cli import app, main
        import typer
        names = [c.name for c in typer.main.get_command(app).commands.values()]
        assert len(names) >= 13, names
        for argv in (["--help"], *[[n, "--help"] for n in names]):
            try:
                main(argv)
            except SystemExit as e:
                assert e.code == 0, (argv, e.code)
        print("loaded:", *[m for m in {HEAVY!r} if m in sys.modules])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: mixlens analyze" in proc.stdout and "compare-local-global" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "loaded:"


@pytest.mark.slow  # starts fresh processes
def test_import_mixlens_is_lazy_and_complete():
    code = (
        "import sys, mixlens; assert 'torch' not in sys.modules; "
        "assert mixlens.load.__module__ == 'mixlens.lens' and 'norm' in mixlens.methods.names(); print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_default_output_file_table(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["analyze", SENTENCE], capsys)
    assert code == 0, err
    for variant in ("W", "N", "Res-W", "Res-N", "ResLN-N"):
        assert variant in out
    data = json.loads((tmp_path / "mixlens-analysis.json").read_text())
    assert set(data["inputs"][0]["methods"]) == {"attention", "norm", "norm_res", "norm_resln"}


def test_json_contract(capsys):
    code, out, _ = run_cli(
        ["analyze", SENTENCE, "a second, longer text with some more words", "--format", "json"], capsys
    )
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"model", "version", "inputs"}
    assert len(data["inputs"]) == 2
    for item in data["inputs"]:
        assert set(item) == {"text", "tokens", "methods", "mixing_ratio", "reconstruction_error"}
        n = len(item["tokens"])
        assert item["tokens"][0] == "[CLS]" and item["tokens"][-1] == "[SEP]"
        for m in item["methods"].values():
            assert m["dims"] == ["layer", "target", "source"]
            assert np.asarray(m["values"]).shape == (6, n, n)
        assert np.allclose(np.asarray(item["methods"]["attention"]["values"]).sum(-1), 1, atol=1e-5)
        assert set(item["mixing_ratio"]) == {"W", "N", "Res-W", "Res-N", "ResLN-N"}
        assert all(len(v) == 6 for v in item["mixing_ratio"].values())
        assert item["reconstruction_error"] <= 1e-4


def test_heads_and_out_file(capsys, tmp_path):
    dest = tmp_path / "sub" / "res.json"
    code, _, err = run_cli(
        [
            "analyze",
            SENTENCE,
            "--heads",
            "--method",
            "attention",
            "--method",
            "norm",
            "--format",
            "json",
            "--out",
            str(dest),
        ],
        capsys,
    )
    assert code == 0
    item = json.loads(dest.read_text())["inputs"][0]
    assert item["methods"]["norm"]["dims"] == ["layer", "head", "target", "source"]
    assert np.asarray(item["methods"]["attention"]["values"]).shape[:2] == (6, 12)


@pytest.mark.parametrize(
    "args, message",
    [
        (["analyze", ""], "empty"),
        (["analyze", "   "], "empty"),
        (["analyze", "x", "--model", "/definitely/not/here"], "does not exist"),
        (["analyze", "x", "--method", "nonsense"], "valid methods: "),
        (["analyze", "x", "--option", "norm.heads"], "METHOD.KEY=VALUE"),
        (["analyze", "x", "--frobnicate"], "No such option"),
        (["analyze", "x", "--format", "xml"], "xml"),
        (["analyze", "x", "--model-head", "tail"], "unknown head"),
    ],
)
def test_bad_input_one_line_exit_2(args, message, capsys):
    code, out, err = run_cli(args, capsys)
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_directory_that_is_not_a_model(tmp_path, capsys):
    code, _, err = run_cli(["analyze", "x", "--model", str(tmp_path)], capsys)
    assert code == 2 and "not a Hugging Face model directory" in err


def test_too_long_with_and_without_truncation(capsys):
    long_text = "word " * 600
    code, _, err = run_cli(["analyze", long_text, "--no-truncate"], capsys)
    assert code == 2 and "more than the model's position limit of 512 tokens" in err
    code, out, err = run_cli(
        ["analyze", long_text, "--max-length", "40", "--format", "json", "--method", "norm"], capsys
    )
    assert code == 0 and "truncated from 602 to 40 tokens" in err
    assert len(json.loads(out)["inputs"][0]["tokens"]) == 40


def test_unknown_method_fails_before_the_model_loads(capsys):
    code, _, err = run_cli(["analyze", "x", "--method", "bogus", "--model", "/definitely/not/here"], capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "unknown method 'bogus'" in err
