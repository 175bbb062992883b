"""What a new user trips over first (issue 45, item 9): --version, "did you mean" for a mistyped method, a mistyped
local model path or a GGUF file given to --model said as such, arguments checked before torch is imported, and a
causal LM's --target typed without its leading space."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixlens import __version__
from mixlens.errors import MixlensError
from tests.conftest import run_cli

SMOLLM = Path(os.environ.get("MIXLENS_MODELS", Path.home() / ".cache" / "mixlens" / "models")) / "smollm2-135m-instruct"


def test_version(capsys):
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.strip() == f"mixlens {__version__}"


@pytest.mark.parametrize("command", [["analyze", "x"], ["explain", "x"], ["report", "x"]])
def test_unknown_method_suggests_the_closest(capsys, command):
    code, _, err = run_cli([*command, "--method", "alti_logt"], capsys)
    assert code == 2 and "unknown method 'alti_logt' (did you mean 'alti_logit'?)" in err
    code, _, err = run_cli([*command, "--method", "zzzz"], capsys)
    assert code == 2 and "unknown method 'zzzz'; valid methods: attention," in err


def test_registry_suggests_the_closest():
    from mixlens.methods import get

    with pytest.raises(MixlensError, match=r"did you mean 'norm_resln'"):
        get("norm_reslm")


def test_mistyped_local_path_is_no_such_folder(tmp_path, capsys, monkeypatch):
    (tmp_path / "models" / "smollm2-135m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["analyze", "x", "--model", "models/smolm2-135m"], capsys)
    assert code == 2 and "model path 'models/smolm2-135m' does not exist: no such folder" in err
    assert "did you mean 'smollm2-135m'" in err
    code, _, err = run_cli(["analyze", "x", "--model", "./nothing-here"], capsys)
    assert code == 2 and "model path './nothing-here' does not exist: no such folder" in err


def test_gguf_file_to_model_suggests_gguf_file(tmp_path, capsys):
    (tmp_path / "m.Q8_0.gguf").write_bytes(b"GGUF")
    code, _, err = run_cli(["explain", "x", "--model", str(tmp_path / "m.Q8_0.gguf")], capsys)
    assert code == 2 and f"--model {tmp_path} --gguf-file m.Q8_0.gguf" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", "x", "--method", "bogus"],
        ["explain", "x", "--model", "./no/such/folder"],
        ["report", "x", "--model", "weights.gguf"],
        ["plot", "x", "-o", "f.png", "--method", "norm_reln"],
    ],
)
def test_bad_arguments_fail_before_torch_is_imported(argv, tmp_path):
    """The errors above come from the arguments alone: torch (seconds to import) is never loaded for them."""
    code = (
        "import sys\nfrom mixlens.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    print('exit', e.code, 'torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.stdout.strip() == "exit 2 False", proc.stdout + proc.stderr


def test_unspaced_target_warns(capsys):
    if not (SMOLLM / "config.json").is_file():
        pytest.skip("smollm2-135m-instruct not fetched (python scripts/fetch_models.py smollm2-135m-instruct)")
    text = "The keys to the cabinet"
    argv = ["explain", text, "--model", str(SMOLLM), "--method", "logit_attn", "--target", "are", "--foil", " is"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "warning: --target 'are' has no leading space" in err and "pass --target ' are'" in err
    assert "--foil" not in err  # ' is' keeps its space
    code, _, err = run_cli([*argv[:-4], "--target", " are", "--foil", " is"], capsys)
    assert code == 0 and "no leading space" not in err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reconstruction_error_is_said_against_the_dtypes_tolerance(bundled, dtype, capsys, tmp_path):
    """Issue 45 item 6: a bfloat16 run printed 'reconstruction error (max abs): 5.45e+01' with no context; the line
    now gives the share of the check's tolerance for the run's dtype (≤ 1: the check passed)."""
    from mixlens.methods.norms import TOLERANCES
    from mixlens.viz.terminal.analysis import error_line

    res = bundled.analyze(["The keys to the cabinet are on the table."], ["norm"])
    err, share = float(res.reconstruction_error.max()), float(res.error_share.max())
    assert 0 < share <= 1  # each error against its own tolerance (relative to its token's size)
    assert error_line(err, res.error_share, "float32").startswith(f"reconstruction error: max abs {err:.2g} = ")
    code, out, errs = run_cli(
        ["analyze", "a short text", "--method", "norm", "--dtype", dtype, "-o", str(tmp_path / "a")], capsys
    )
    assert code == 0, errs
    line = next(ln for ln in out.splitlines() if ln.startswith("reconstruction error"))
    assert f"× the {dtype} tolerance" in line
    assert f"to {TOLERANCES[getattr(torch, dtype)]:g} of its size" in out
