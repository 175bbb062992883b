"""`--backend ray-data`: the same numbers as the local backend on a two-node Ray cluster (norm family, a rollout, an
explain method), resume after SIGKILL of the driver, an actor killed mid-run, and bad input as one line.

The cluster is two `ray start` nodes on this machine (one CPU each, its own temp folder and ports, stopped in the
fixture's teardown), so a block read on one node is computed by an actor on the other."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixlens.corpus.runner import run_corpus
from mixlens.errors import MixlensError
from tests.corpus.test_corpus import cli, synth

pytest.importorskip("ray.data")

METHODS = ["norm", "norm_res", "norm_resln", "attention_rollout", "saliency"]
N = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(address, process groups): a head and a second node, 1 CPU each; both stopped (by process group) at the end."""
    temp = tempfile.mkdtemp(prefix="mxray")  # short: Ray's socket paths must stay under 107 characters
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--num-cpus", "1", "--disable-usage-stats", "--node-ip-address", "127.0.0.1"]  # loopback only
    procs: list[subprocess.Popen] = []
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update({k: env[k] for k in saved})
    try:
        procs.append(
            subprocess.Popen(
                [_ray_bin(), "start", "--head", "--port", str(port), "--temp-dir", temp, "--include-dashboard",
                 "false", *common],
                env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip
        _wait_port(port)
        procs.append(
            subprocess.Popen(
                [_ray_bin(), "start", "--address", address, *common],
                env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        )  # fmt: skip
        import ray

        ray.init(address=address, log_to_driver=False)
        try:
            deadline = time.time() + 180
            while len([n for n in ray.nodes() if n["Alive"]]) < 2:
                assert time.time() < deadline, "the second Ray node did not join"
                time.sleep(0.5)
        finally:
            ray.shutdown()
        yield address, [p.pid for p in procs]
    finally:
        for p in reversed(procs):
            with _suppress():
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
            with _suppress():
                os.killpg(p.pid, signal.SIGKILL)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        subprocess.run(["rm", "-rf", temp], check=False)


def _suppress():
    import contextlib

    return contextlib.suppress(ProcessLookupError, PermissionError)


def _wait_port(port: int) -> None:
    deadline = time.time() + 180
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            assert time.time() < deadline, "the Ray head did not start"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def local(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("rdlocal")
    data = synth(d / "d.tsv", N)
    return data, run_corpus(data, d / "local", METHODS, model=tiny_model, shard_size=8, store="full")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer) -> str:
    from tests.conftest import random_model

    d = tmp_path_factory.mktemp("rdtiny")
    random_model("bert", tokenizer).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return str(d)


def same_numbers(a, b) -> None:
    """Every per-example column (matched by source index) and every aggregate ≤ 1e-5 apart; same index set."""
    ea, eb = a.examples(), b.examples()
    assert ea["index"].tolist() == eb["index"].tolist() == list(range(N))
    assert sorted(ea.columns) == sorted(eb.columns)
    for col in ea.columns:
        x, y = ea[col].tolist(), eb[col].tolist()
        if isinstance(x[0], str) or col in ("tokens", "index", "n_tokens") or col.endswith(".shape"):
            assert [np.asarray(v).tolist() for v in x] == [np.asarray(v).tolist() for v in y], col
        else:
            for u, v in zip(x, y, strict=True):
                np.testing.assert_allclose(np.stack(u) if np.ndim(u) and np.asarray(u).dtype == object else u,
                                           np.stack(v) if np.ndim(v) and np.asarray(v).dtype == object else v,
                                           atol=1e-5, err_msg=col)  # fmt: skip
    ta, tb = a.aggregate(), b.aggregate()
    keys = ["stat", "method", "layer", "head", "count"]
    assert ta[keys].equals(tb[keys])
    for col in ("mean", "std", "min", "max"):
        np.testing.assert_allclose(ta[col], tb[col], atol=1e-5, err_msg=col)
    assert a.manifest["counts"] == b.manifest["counts"]


def full_shards(manifest: dict, size: int = 8) -> bool:
    """Every shard of a one-file run holds `size` examples but the last: Ray Data's block shaping (which cuts and
    joins blocks by bytes) did not split shards into pieces."""
    sizes = [s["examples"] for s in manifest["shards"]]
    return sizes == [size] * (N // size) + ([N % size] if N % size else [])


@pytest.mark.slow  # a two-node Ray cluster
def test_two_nodes_match_local(cluster, local, tiny_model, tmp_path):
    address, _ = cluster
    data, loc = local
    res = run_corpus(data, tmp_path / "rd", METHODS, model=tiny_model, shard_size=8, store="full",
                     backend="ray-data", address=address, workers=2)  # fmt: skip
    assert res.manifest["complete"] and res.manifest["ray"]["actors"] == 2
    assert res.manifest["job"]["layout"] == "index"
    assert full_shards(res.manifest) and not res.manifest["ray"]["tokenize_stage"]  # the actors tokenised
    same_numbers(loc, res)
    before = _shard_files(tmp_path / "rd")
    again = run_corpus(data, tmp_path / "rd", METHODS, model=tiny_model, shard_size=8, store="full",
                       backend="ray-data", address="127.0.0.1:1")  # fmt: skip  # finished: no Ray is contacted
    assert again.manifest["resumed_shards"] == len(before) and _shard_files(tmp_path / "rd") == before
    assert {**again.manifest, "resumed_shards": 0} == res.manifest


def _shard_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "shards").glob("shard-*.parquet"))}


def _indexes(out: Path) -> list[int]:
    return sorted(
        i
        for p in (out / "shards").glob("shard-*.parquet")
        for i in pq.read_table(p, columns=["index"])["index"].to_pylist()
    )


def _cmd(data: Path, model: str, out: Path | str, address: str) -> list[str]:
    return [sys.executable, "-m", "mixlens", "corpus", "--data", str(data), "--model", model, "--out", str(out),
            "--shard-size", "8", "--store", "full", "--backend", "ray-data", "--address", address, "--concurrency",
            "2", "--quiet", *sum((["--method", m] for m in METHODS), [])]  # fmt: skip


def _wait_shards(out: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.time() + 400
    while len(list((out / "shards").glob("shard-*.parquet"))) < n:
        assert proc.poll() is None, "the run ended before it was killed"
        assert time.time() < deadline, "the run made no progress"
        time.sleep(0.05)


@pytest.mark.slow  # a two-node Ray cluster
def test_driver_sigkill_then_rerun_fills_the_rest(cluster, local, tiny_model, tmp_path):
    """--out as a file:// URI: the actors write through pyarrow's filesystem, the rerun resumes from it."""
    address, _ = cluster
    data, loc = local
    out = tmp_path / "killed"
    uri = f"file://{out}"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(_cmd(data, tiny_model, uri, address), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        _wait_shards(out, proc, 1)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    before = _shard_files(out)
    idx = _indexes(out)
    assert 0 < len(idx) < N and len(idx) == len(set(idx))
    time.sleep(2)  # let Ray end the dead driver's actors
    res = run_corpus(data, uri, METHODS, model=tiny_model, shard_size=8, store="full", backend="ray-data",
                     address=address, workers=2)  # fmt: skip
    assert res.out == uri
    after = _shard_files(out)
    assert all(after[k] == v for k, v in before.items() if k in after)  # finished shards were not recomputed
    assert _indexes(out) == list(range(N))  # no duplicated, no missing index
    assert res.manifest["complete"] and res.manifest["resumed_shards"] >= 1
    same_numbers(loc, res)


@pytest.mark.slow  # a two-node Ray cluster
def test_filesystem_folder_out_resumes_with_a_tokenizing_cpu(cluster, local, tiny_model, tmp_path):
    """--out on a pyarrow filesystem that is not the local one (a SubTreeFileSystem: temp file + move, no lock):
    one actor of 1 CPU and tokenising tasks of 1 CPU on the two 1-CPU nodes; shards lost from an interrupted run
    are computed again by the rerun, and only they."""
    import pyarrow.fs as pafs

    from mixlens.corpus.outdir import OutDir

    address, _ = cluster
    data, loc = local
    (tmp_path / "st").mkdir()
    out = OutDir(pafs.SubTreeFileSystem(str(tmp_path / "st"), pafs.LocalFileSystem()), "run", "subtree:run")
    kw = {"model": tiny_model, "shard_size": 8, "store": "full", "backend": "ray-data", "address": address}
    res = run_corpus(data, out, METHODS, workers=1, tokenize_cpus=1, **kw)
    assert res.manifest["ray"]["actors"] == 1 and res.manifest["ray"]["tokenize_cpus"] == 1
    assert res.manifest["ray"]["tokenize_stage"]
    assert sum(res.manifest["ray"]["nodes"].values()) == N
    assert full_shards(res.manifest)
    same_numbers(loc, res)
    folder = tmp_path / "st" / "run"
    before = _shard_files(folder)
    lost = sorted(before)[1::2]
    for name in lost:  # as if the run had stopped before these shards were written
        (folder / "shards" / name).unlink()
    man = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**man, "complete": False}))
    again = run_corpus(data, out, METHODS, workers=2, **kw)
    assert again.manifest["resumed_shards"] == len(before) - len(lost)
    recomputed = sum(len(pq.read_table(pa.BufferReader(before[k]))) for k in lost)
    assert sum(again.manifest["ray"]["nodes"].values()) == recomputed  # only the lost rows were computed
    assert _indexes(folder) == list(range(N))  # no duplicated, no missing index
    same_numbers(loc, again)
    with pytest.raises(MixlensError, match="need more than the cluster's 2 CPUs"):
        run_corpus(data, tmp_path / "toomany", METHODS, workers=2, tokenize_cpus=1, **kw)


def _parent(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return 0


def _actor_pids(nodes: list[int]) -> list[int]:
    """Processes that hold a ShardWriter actor and descend from this test's `ray start` processes (no other Ray)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if "ShardWriter" not in (d / "cmdline").read_bytes().decode(errors="replace"):
                continue
            pid = int(d.name)
            while pid > 1 and pid not in nodes:
                pid = _parent(pid)
        except (OSError, ValueError):
            continue
        if pid in nodes:
            pids.append(int(d.name))
    return pids


@pytest.mark.slow  # a two-node Ray cluster
def test_actor_sigkill_is_retried(cluster, local, tiny_model, tmp_path):
    address, groups = cluster
    data, loc = local
    out = tmp_path / "actor"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(_cmd(data, tiny_model, out, address), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    try:
        _wait_shards(out, proc, 1)
        pids = _actor_pids(groups)
        assert pids, "no actor process found"
        os.kill(pids[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=500)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if proc.returncode != 0:  # Ray gave up on the batch: one line, and the rerun fills the rest
        assert proc.returncode == 2 and "rerun the same command" in err.decode(), err.decode()[-2000:]
        res = run_corpus(data, out, METHODS, model=tiny_model, shard_size=8, store="full", backend="ray-data",
                         address=address, workers=2)  # fmt: skip
    else:
        from mixlens.corpus import CorpusResult

        res = CorpusResult.open(out)
    assert _indexes(out) == list(range(N))
    same_numbers(loc, res)


# ------------------------------------------------------------------------------------------------ bad input


def _parquet_folder(d: Path, mismatch: bool) -> Path:
    d.mkdir()
    pq.write_table(pa.table({"text": ["a cat sat", "the dog ran"], "label": [0, 1]}), d / "part-0.parquet")
    label = pa.array(["x", "y"]) if mismatch else pa.array([1, 0])
    pq.write_table(pa.table({"text": ["red house", "big tree"], "label": label}), d / "part-1.parquet")
    return d


@pytest.mark.parametrize("case", ["missing_file", "missing_uri", "schema_mismatch", "unreachable", "out_not_writable"])
def test_bad_input_one_line_exit_2(tmp_path, tiny_model, capsys, case):
    data = synth(tmp_path / "d.tsv", 4)
    out = tmp_path / "out"
    extra: list[str] = []
    if case == "missing_file":
        data = tmp_path / "nope.jsonl"
    elif case == "missing_uri":
        data = Path(f"file://{tmp_path}/nope.parquet")
    elif case == "schema_mismatch":
        data = _parquet_folder(tmp_path / "pq", mismatch=True)
    elif case == "unreachable":
        extra = ["--address", f"127.0.0.1:{_free_port()}"]
    else:
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "out"
    code = cli("corpus", "--data", str(data), "--out", str(out), "--model", tiny_model, "--backend", "ray-data",
               "--quiet", *extra)  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    want = {
        "missing_file": "does not exist",
        "missing_uri": "does not exist",
        "schema_mismatch": "does not have the schema",
        "unreachable": "cannot connect to Ray",
        "out_not_writable": "cannot write",
    }[case]
    assert want in err
    if case != "unreachable":
        assert not out.exists()


def test_parquet_folder_parts_number_rows_across_files(tmp_path):
    from mixlens.corpus import raydata
    from mixlens.corpus.readers import examples_from, open_records

    folder = _parquet_folder(tmp_path / "pq", mismatch=False)
    files = raydata.input_files(str(folder), None)
    parts = raydata.plan_parts(files, "parquet")
    assert [(p.start, p.rows) for p in parts] == [(0, 2), (2, 2)]
    got = []
    for p in parts:
        _, records = open_records(p.src, "parquet", row_groups=list(p.row_groups or ()))
        got += [(e.index, e.text) for e in examples_from(records, "text", None, False, None, "x", start=p.start)]
    assert got == [(0, "a cat sat"), (1, "the dog ran"), (2, "red house"), (3, "big tree")]


def test_oom_and_actor_death_are_named(tmp_path):
    import ray

    from mixlens.corpus.raydata import explain_failure

    oom = ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")
    wrapped = RuntimeError("execution failed")
    wrapped.__cause__ = oom
    assert "out-of-memory killer" in explain_failure(wrapped, ray)
    from mixlens.errors import MixlensError

    inner = RuntimeError("UDF failed")
    inner.__cause__ = MixlensError("model folder 'x' does not exist")
    assert explain_failure(inner, ray) == "model folder 'x' does not exist"


def test_layout_is_part_of_the_identity_only_when_not_the_default():
    from dataclasses import replace

    from mixlens.corpus.job import Job

    job = Job(None, "m", "d.tsv", None, "sentence", None, ("norm",))
    assert "layout" not in job.identity()  # job ids of existing runs stay the same
    other = replace(job, layout="index")
    assert other.identity()["layout"] == "index" and other.job_id != job.job_id


@pytest.mark.parametrize("pair", [False, True])
def test_tokenizing_stage_gives_the_shard_the_compute_step_gives(tiny_model, pair):
    """The CPU stage's token ids (truncation included), restored in the actor, make the same shard as tokenizing
    inside the compute step: same packing, same padding, same bytes (no Ray needed)."""
    import json

    from mixlens.batching import Tokenized
    from mixlens.corpus.compute import compute_shard
    from mixlens.corpus.job import Job
    from mixlens.corpus.raydata import shard_examples, shard_row, tokenize_block
    from mixlens.corpus.readers import Example
    from mixlens.lens import load

    words = "the cat sat on a mat , and then it ran far away from the big dog".split()
    texts = [" ".join(words[: 3 + (7 * k) % 15]) for k in range(11)]
    examples = [Example(10 + k, (t, texts[-k - 1]) if pair else t, {"label": k % 2}) for k, t in enumerate(texts)]
    job = Job(
        tiny_model, "tiny", "d", None, "a", "b" if pair else None, ("norm_resln", "attention_rollout"),
        store="full", max_length=12, batch_size=4,
    )  # fmt: skip
    (row,) = tokenize_block(shard_row(examples, pair), job).to_pylist()
    assert shard_examples(row) == examples  # the shard row carries its examples whole, in order
    assert max(row["n_tokens"]) == 12 and max(row["truncated_from"]) > 12  # some inputs were cut to the limit
    tok = Tokenized.restore(row["ids"], row["types"], row["words"], row["truncated_from"])
    lens = load(tiny_model)
    staged, info = compute_shard(lens, job, 10, examples, tokenized=tok)
    inline, info2 = compute_shard(lens, job, 10, examples)
    assert info == info2
    a, b = pq.read_table(pa.BufferReader(staged)), pq.read_table(pa.BufferReader(inline))
    assert a.equals(b)
    assert json.loads(a.schema.metadata[b"mixlens.sums"]) == json.loads(b.schema.metadata[b"mixlens.sums"])


def test_read_tasks_import_no_torch(tmp_path):
    """A read task (on a CPU node of a cluster, maybe without torch's threads to spare) parses its part into shard
    rows and writes its bad-record counts without importing torch, transformers or the model code."""
    data = synth(tmp_path / "d.tsv", 20)
    code = f"""
import json, sys
import numpy as np
from mixlens.corpus import raydata
from mixlens.corpus.outdir import OutDir
from mixlens.corpus.readers import FsFile
import pyarrow.fs as pafs
out = OutDir.of({str(tmp_path / "out")!r})
out.mkdir(raydata.SKIP_DIR)
path = {str(data)!r}
part = raydata.Part(0, FsFile(pafs.LocalFileSystem(), path, path, {data.stat().st_size}))
blocks = raydata.read_part(part, "tsv", "sentence", None, False, np.array([3]), out, 8)
rows = [r for t in blocks for r in t.to_pylist()]
print(json.dumps([[len(r["index"]) for r in rows], rows[0]["index"][:4], sorted(m for m in ("torch", "transformers",
      "mixlens.lens") if m in sys.modules)]))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    sizes, first, heavy = json.loads(res.stdout.strip().splitlines()[-1])
    assert sizes == [8, 8, 3] and first == [0, 1, 2, 4]  # shard rows of 8 examples; index 3 was already claimed
    assert heavy == []
    assert (tmp_path / "out" / "skipped" / "part-00000.json").exists()
