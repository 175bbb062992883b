"""Parallel corpus backends give the same shards and aggregates as the in-process run: 2 local worker
processes, and a local Ray cluster with 2 actors (skipped when Ray is not installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mixlens.corpus.runner import CorpusResult, run_corpus
from tests.conftest import random_model
from tests.corpus.test_corpus import synth

pytestmark = pytest.mark.slow  # Ray workers and worker processes: tens of seconds each

METHODS = ["attention", "norm_resln"]
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("par")
    model = d / "tiny"
    random_model("bert", tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    data = synth(d / "d.tsv", 12)
    local = run_corpus(data, d / "local", METHODS, model=str(model), shard_size=3, store="full")
    return data, str(model), local


def _same_run(a, b) -> None:
    assert a.manifest["counts"] == b.manifest["counts"] and a.manifest["job_id"] == b.manifest["job_id"]
    assert [s["shard"] for s in a.manifest["shards"]] == [s["shard"] for s in b.manifest["shards"]] == [0, 1, 2, 3]
    ea, eb = a.examples(), b.examples()
    assert ea["index"].tolist() == eb["index"].tolist() == list(range(12))
    for col in ("ratio.ResLN-N", "attention.entropy"):
        np.testing.assert_allclose(np.stack(ea[col].tolist()), np.stack(eb[col].tolist()), atol=1e-5)
    for m in METHODS:
        for x, y in zip(ea[m], eb[m], strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5)
    ta, tb = (pq.read_table(r.out / "aggregate.parquet").to_pandas() for r in (a, b))
    assert ta[["stat", "method", "layer", "head", "count"]].equals(tb[["stat", "method", "layer", "head", "count"]])
    np.testing.assert_allclose(ta["mean"], tb["mean"], atol=1e-6)


def test_worker_processes_match_local(setup, tmp_path):
    data, model, local = setup
    _same_run(local, run_corpus(data, tmp_path / "w", METHODS, model=model, shard_size=3, store="full", workers=2))


def test_ray_backend_matches_local(setup, tmp_path):
    """Run in a child process: a local Ray session in this process would stay in Ray's process-wide state and break
    the Ray Data cluster tests that follow (an actor pool whose constructor arguments were freed)."""
    pytest.importorskip("ray")
    data, model, local = setup
    out = tmp_path / "r"
    code = (
        "import ray, sys\n"
        "from mixlens.corpus.runner import run_corpus\n"
        "ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)\n"
        "try:\n"
        f"    run_corpus({str(data)!r}, {str(out)!r}, {METHODS!r}, model={model!r}, shard_size=3, store='full',\n"
        "               backend='ray', workers=2)\n"
        "finally:\n"
        "    ray.shutdown()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _same_run(local, CorpusResult.open(out))
