"""`--out` as a filesystem URI or a folder on any `pyarrow.fs.FileSystem` (`OutDir`): the same files as a local
path, resume on it, bad output locations as one line; the Ray Data flags checked before Ray starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from mixlens.corpus.outdir import OutDir
from mixlens.corpus.runner import CorpusResult, run_corpus
from mixlens.errors import MixlensError
from tests.corpus.test_corpus import cli, synth, tiny  # noqa: F401  (the module's tiny model fixture)

N = 20


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "shards").glob("shard-*.parquet"))}


def _subtree(root: Path, rel: str) -> OutDir:
    """A folder on a filesystem that is not this machine's LocalFileSystem (writes go through temp file + move)."""
    root.mkdir(exist_ok=True)
    return OutDir(pafs.SubTreeFileSystem(str(root), pafs.LocalFileSystem()), rel, f"subtree:{rel}")


def test_uri_and_subtree_filesystem_write_what_a_local_path_writes(tmp_path, tiny):  # noqa: F811
    data = synth(tmp_path / "d.tsv", N)
    kw = {"model": tiny, "shard_size": 8, "store": "full"}
    ref = run_corpus(data, tmp_path / "plain", ["norm", "attention_rollout"], **kw)
    uri = run_corpus(data, f"file://{tmp_path}/uri", ["norm", "attention_rollout"], **kw)
    sub = run_corpus(data, _subtree(tmp_path / "st", "runs/a"), ["norm", "attention_rollout"], **kw)
    assert isinstance(ref.out, Path) and uri.out == f"file://{tmp_path}/uri"
    want = _files(tmp_path / "plain")
    assert len(want) == 3
    assert _files(tmp_path / "uri") == want and _files(tmp_path / "st" / "runs" / "a") == want
    for res in (uri, sub):
        assert res.manifest == ref.manifest
        assert res.aggregate().equals(ref.aggregate())
        assert res.examples().equals(ref.examples())
    reopened = CorpusResult.open(f"file://{tmp_path}/uri")
    assert reopened.manifest == ref.manifest and reopened.examples().equals(ref.examples())
    assert not list((tmp_path / "st").rglob("*.tmp"))  # every temp file was moved into place


def test_resume_on_a_filesystem_folder_computes_only_the_missing_shards(tmp_path, tiny):  # noqa: F811
    data = synth(tmp_path / "d.tsv", N)
    out = _subtree(tmp_path / "st", "run")
    folder = tmp_path / "st" / "run"
    first = run_corpus(data, out, ["norm"], model=tiny, shard_size=4)
    before = _files(folder)
    assert len(before) == 5
    (folder / "shards" / "shard-00002.parquet").unlink()  # an interrupted run: shards missing, a temp left over
    (folder / "shards" / "shard-00004.parquet").unlink()
    (folder / "shards" / ".shard-00002.parquet.x1.tmp").write_bytes(b"half")
    man = json.loads((folder / "manifest.json").read_text())
    man["complete"] = False
    (folder / "manifest.json").write_text(json.dumps(man))
    again = run_corpus(data, out, ["norm"], model=tiny, shard_size=4)
    assert again.manifest["resumed_shards"] == 3 and again.manifest["complete"]
    assert _files(folder) == before  # the two missing shards are computed again, the same bytes
    assert not (folder / "shards" / ".shard-00002.parquet.x1.tmp").exists()
    idx = [i for p in sorted((folder / "shards").glob("*.parquet")) for i in pq.read_table(p)["index"].to_pylist()]
    assert sorted(idx) == list(range(N))  # no duplicated, no missing example
    assert {**again.manifest, "resumed_shards": 0} == {**first.manifest, "resumed_shards": 0}
    np.testing.assert_array_equal(again.aggregate()["mean"], first.aggregate()["mean"])


@pytest.mark.parametrize("backend", ["local", "ray-data"])
@pytest.mark.parametrize("case", ["not_writable", "unknown_scheme"])
def test_output_uri_that_cannot_be_written_is_one_line(tmp_path, tiny, capsys, backend, case):  # noqa: F811
    data = synth(tmp_path / "d.tsv", 4)
    (tmp_path / "file").write_text("x")
    out = f"file://{tmp_path}/file/out" if case == "not_writable" else "nosuchscheme://bucket/run"
    code = cli("corpus", "--data", str(data), "--out", out, "--model", tiny, "--backend", backend, "--quiet")
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert ("cannot write" if case == "not_writable" else "cannot use --out 'nosuchscheme://bucket/run'") in err
    assert (tmp_path / "file").read_text() == "x"


def test_subtree_folder_that_cannot_be_written(tmp_path, tiny):  # noqa: F811
    data = synth(tmp_path / "d.tsv", 4)
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "file").write_text("x")
    with pytest.raises(MixlensError, match="cannot write") as e:
        run_corpus(data, _subtree(tmp_path / "st", "file/out"), ["norm"], model=tiny)
    assert "subtree:file/out" in str(e.value) and len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "want"),
    [
        (["--backend", "ray-data", "--tokenize-cpus", "-1"], "--tokenize-cpus must be a number of at least 0"),
        (["--backend", "ray-data", "--tokenize-cpus", "nan"], "--tokenize-cpus must be a number of at least 0"),
        (["--backend", "ray-data", "--num-cpus", "-0.5"], "--num-cpus must be a number of at least 0"),
        (["--tokenize-cpus", "1"], "--tokenize-cpus applies to --backend ray-data only"),
    ],
)
def test_ray_data_resource_flags_checked_before_ray_starts(tmp_path, tiny, capsys, args, want):  # noqa: F811
    data = synth(tmp_path / "d.tsv", 4)
    code = cli("corpus", "--data", str(data), "--out", str(tmp_path / "o"), "--model", tiny, "--quiet", *args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and want in err, err
    assert not (tmp_path / "o").exists()


def test_missing_ranges_name_the_rows_no_shard_holds():
    from mixlens.corpus.raydata import missing_ranges

    assert missing_ranges(np.arange(10), 10) == (0, "")
    claimed = np.array([0, 1, 2, 5, 6, 9])
    assert missing_ranges(claimed, 12) == (6, "3–4, 7–8, 10–11")
    assert missing_ranges(np.array([1, 3, 5, 7, 9]), 11, most=2) == (6, "0, 2, … (4 more ranges)")


class _FakeRay:
    def __init__(self, *cpus: float, gpus: float = 0) -> None:
        self._nodes = [{"Alive": True, "Resources": {"CPU": c, "GPU": gpus}} for c in cpus]

    def nodes(self) -> list[dict]:
        return self._nodes


def test_pools_the_cluster_cannot_place_are_one_line():
    from mixlens.corpus.raydata import check_resources

    two = _FakeRay(1, 1)
    check_resources(two, 2, 1, 0, 0)  # one actor per CPU, tokenising beside the reads: fits
    check_resources(two, 1, 1, 0, 1)  # one actor and a tokenising CPU: fits
    with pytest.raises(MixlensError, match="need more than the cluster's 2 CPUs"):
        check_resources(two, 2, 1, 0, 1)
    with pytest.raises(MixlensError, match="--tokenize-cpus 2: no node of the Ray cluster has 2 CPUs"):
        check_resources(two, 1, 0, 0, 2)
    with pytest.raises(MixlensError, match="--num-gpus 1: no node"):
        check_resources(two, 1, 0, 1, 0)
