"""experiments/finetune_sst2.py keeps working: a few steps on a handful of SST-2 sentences, twice with the same
seed (identical weights), and the saved folder loads as a classifier whose logits DecompX decomposes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from safetensors.torch import load_file

import mixlens
from mixlens.lens import default_model_path
from mixlens.methods import decompx as dx
from tests.conftest import data_file

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "finetune_sst2.py"


def _script():
    spec = importlib.util.spec_from_file_location("finetune_sst2", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_finetune_few_steps_deterministic(tmp_path, capsys):
    data = data_file("sst2", "dev.tsv")
    script = _script()
    args = [
        "--data",
        str(data),
        "--train",
        "8",
        "--held-out",
        "4",
        "--epochs",
        "1",
        "--batch-size",
        "4",
        "--skip-head-diff",
    ]
    threads = torch.get_num_threads()
    try:
        for run in ("a", "b"):
            script.main([*args, "--out", str(tmp_path / run)])
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)
    out = capsys.readouterr().out
    assert "8 training / 4 held-out sentences" in out and "trained 2 steps" in out
    assert out.count("held-out accuracy after fine-tuning:") == 2
    a, b = (load_file(tmp_path / run / "model.safetensors") for run in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(default_model_path() / "model.safetensors")
    moved = [k for k in base if "encoder" in k and not torch.equal(base[k], a.get(k, a.get(f"bert.{k}", base[k])))]
    assert moved  # the encoder was trained, not only the head
    lens = mixlens.load(tmp_path / "a")
    assert type(lens.model).__name__ == "BertForSequenceClassification"
    tr = lens.trace(["a charming and often affecting journey"], ffn=True)
    assert dx.decompose(tr, 0).error < 1e-5
