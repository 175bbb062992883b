"""Corpus runs: readers, batching, mergeable sums, exactness against Lens.analyze, resume after SIGKILL,
bad input through the real CLI."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mixlens.cli import main
from mixlens.corpus import ReadStats, iter_examples
from mixlens.corpus.runner import CorpusResult, plan_batches, run_corpus
from mixlens.corpus.shards import Sums
from mixlens.errors import MixlensError
from mixlens.stats.tokens import row_entropy, token_kinds, token_type_masses
from tests.conftest import data_file, random_model

WORDS = "the a cat dog sat on mat and then ran away quickly , . ! big small red house tree".split()


def synth(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = ["sentence\tlabel"] + [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 20))) + f"\t{i % 2}" for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer) -> str:
    """A small random BERT saved as a local model directory (loadable by worker processes and the CLI)."""
    d = tmp_path_factory.mktemp("tiny")
    random_model("bert", tokenizer).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return str(d)


def cli(*args: str) -> int:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    return e.value.code


# ------------------------------------------------------------------------------------------------ readers


def test_readers_all_formats_same_examples(tmp_path):
    rows = [{"text": "hello there", "label": 1}, {"text": 'a, "quoted" one', "label": 0}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a.csv").write_text('text,label\nhello there,1\n"a, ""quoted"" one",0\n')
    (tmp_path / "a.tsv").write_text('text\tlabel\nhello there\t1\na, "quoted" one\t0\n')
    (tmp_path / "a.txt").write_text('hello there\n\na, "quoted" one\n')
    pq.write_table(
        pa.table({"text": [r["text"] for r in rows], "label": [1, 0]}), tmp_path / "a.parquet", row_group_size=1
    )
    for suffix in ("jsonl", "csv", "tsv", "txt", "parquet"):
        got = list(iter_examples(tmp_path / f"a.{suffix}"))
        assert [e.text for e in got] == [r["text"] for r in rows], suffix
    assert list(iter_examples(tmp_path / "a.parquet"))[1].fields == {"text": rows[1]["text"], "label": 0}
    assert list(iter_examples(tmp_path / "a.csv"))[1].fields["label"] == "0"


def test_readers_real_glue_files():
    sst = list(iter_examples(data_file("sst2", "dev.tsv")))
    assert len(sst) == 872 and sst[0].fields["label"] in ("0", "1") and '"' not in sst[0].text
    stsb = list(iter_examples(data_file("stsb", "dev.tsv")))  # sentence1/sentence2 are paired by default
    assert len(stsb) == 1500 and isinstance(stsb[0].text, tuple) and stsb[0].fields["score"] == "5.000"


def test_readers_bad_records_counted_or_strict(tmp_path):
    p = tmp_path / "bad.tsv"
    p.write_bytes(b"sentence\tlabel\ngood one\t1\nbad \xff\xfe bytes\t0\nno label\n\t1\nlast one\t0\n")
    st = ReadStats()
    got = list(iter_examples(p, stats=st))
    assert [(e.index, e.text) for e in got] == [(0, "good one"), (4, "last one")]  # indices name source rows
    assert st.as_dict() == {"read": 2, "undecodable": 1, "malformed": 1, "empty": 1}
    with pytest.raises(MixlensError, match="not valid UTF-8"):
        list(iter_examples(p, strict=True))


def test_readers_source_errors(tmp_path):
    with pytest.raises(MixlensError, match="does not exist"):
        iter_examples(tmp_path / "nope.tsv")
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(MixlensError, match="empty"):
        iter_examples(tmp_path / "e.csv")
    (tmp_path / "h.tsv").write_text("sentence\tlabel\n")
    with pytest.raises(MixlensError, match="no rows"):
        list(iter_examples(tmp_path / "h.tsv"))
    (tmp_path / "c.tsv").write_text("a\tb\nx\ty\n")
    with pytest.raises(MixlensError, match="available columns: a, b"):
        iter_examples(tmp_path / "c.tsv", text_column="sentence")
    with pytest.raises(MixlensError, match="cannot tell which column"):
        iter_examples(tmp_path / "c.tsv")
    assert [e.text for e in iter_examples(tmp_path / "c.tsv", text_column="a", pair_column="b")] == [("x", "y")]


def test_hf_source_without_datasets_is_a_clear_error():
    try:
        import datasets  # noqa: F401

        pytest.skip("datasets is installed")
    except ImportError:
        pass
    with pytest.raises(MixlensError, match="needs the 'datasets' package"):
        iter_examples("hf:nyu-mll/glue:sst2:validation")


# ------------------------------------------------------------------------------------- batching and sums


def test_plan_batches_bounds_and_coverage():
    rng = random.Random(1)
    lengths = [rng.randint(1, 60) for _ in range(200)]
    batches = plan_batches(lengths, batch_size=16, max_tokens=300)
    assert sorted(k for b in batches for k in b) == list(range(200))
    for b in batches:
        assert len(b) <= 16 and (len(b) == 1 or len(b) * max(lengths[k] for k in b) <= 300)
    firsts = [lengths[b[0]] for b in batches]
    assert firsts == sorted(firsts, reverse=True)
    assert plan_batches([500, 3], 8, 100) == [[0], [1]]  # longer than max_tokens: a batch of its own


def test_sums_merge_in_any_order_equals_whole():
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(rng.integers(1, 30), 3, 2)) for _ in range(5)]
    whole = np.concatenate(parts)
    merged = Sums()
    for k in (3, 0, 4, 1, 2):
        s = Sums()
        s.add("x", "m", parts[k])
        merged.merge(Sums.from_json(s.to_json()))  # through the on-disk form
    t = merged.table().to_pandas().set_index(["layer", "head"])
    for layer in range(3):
        for h in range(2):
            row = t.loc[(layer, h)]
            v = whole[:, layer, h]
            assert row["count"] == len(v)
            np.testing.assert_allclose(
                [row["mean"], row["std"], row["min"], row["max"]],
                [v.mean(), v.std(), v.min(), v.max()],
                rtol=1e-12,
                atol=1e-12,
            )


# ---------------------------------------------------------------------------------- exactness of a run


def test_corpus_matches_lens_analyze(tmp_path, tiny):
    import mixlens

    lens = mixlens.load(tiny)
    data = synth(tmp_path / "d.tsv", 23)
    texts = [e.text for e in iter_examples(data)]
    res = run_corpus(
        data, tmp_path / "out", ["attention", "norm_resln"], lens=lens, store="full", shard_size=10, batch_size=4
    )
    assert res.manifest["complete"] and res.manifest["counts"]["examples"] == 23
    ex = res.examples()
    assert ex["index"].tolist() == list(range(23)) and ex["text"].tolist() == texts
    ref = lens.analyze(texts, ["attention", "norm_resln"], batch_size=23)
    tokens_all, ratios_all = [], []
    for b in range(23):
        n = len(ref.tokens[b])
        assert ex["tokens"][b].tolist() == ref.tokens[b]
        for m in ("attention", "norm_resln"):
            got = np.asarray(ex[m][b]).reshape(ex[f"{m}.shape"][b])
            np.testing.assert_allclose(got, ref[m].values[b][:, :n, :n], atol=1e-5)
        r = ref.mixing_ratio("ResLN-N", per_token=True)[b][:, :n]  # [L, n]
        np.testing.assert_allclose(np.stack(ex["ratio.ResLN-N"][b]), r.mean(-1), atol=1e-5)
        tokens_all.append(n)
        ratios_all.append(r)
    agg = res.aggregate().set_index(["stat", "method", "layer", "head"])
    per_token = np.concatenate(ratios_all, axis=1)  # [L, all tokens]
    for layer in range(per_token.shape[0]):
        row = agg.loc[("mixing_ratio", "ResLN-N", layer, -1)]
        assert row["count"] == sum(tokens_all)
        assert row["mean"] == pytest.approx(per_token[layer].mean(), abs=1e-6)
    # token-type masses and entropy of the attention maps, straight from the stats module
    enc = lens.encode(texts)
    a = torch.as_tensor(ref["attention"].values)
    mask = enc.inputs["attention_mask"].bool()
    kinds = token_kinds(lens, enc.inputs["input_ids"], mask)
    ent = row_entropy(a, mask).numpy()  # [B, L]
    cls = token_type_masses(a, kinds, mask)["cls"].numpy()
    np.testing.assert_allclose(np.stack(ex["attention.entropy"].tolist()), ent, atol=1e-4)
    assert agg.loc[("mass:cls", "attention", 1, -1)]["mean"] == pytest.approx(cls[:, 1].mean(), abs=1e-5)
    assert agg.loc[("reconstruction_error", "", 0, -1)]["max"] < 1e-4


def test_heads_give_per_layer_head_statistics(tmp_path, tiny):
    import mixlens

    lens = mixlens.load(tiny)
    data = synth(tmp_path / "d.tsv", 6)
    res = run_corpus(data, tmp_path / "out", ["attention"], lens=lens, heads=True)
    agg = res.aggregate()
    ent = agg[(agg.stat == "entropy") & (agg.method == "attention")]
    assert sorted(set(ent["head"])) == [-1, 0, 1, 2, 3]  # head-mean map, and each of the 4 heads
    ex = res.examples()
    assert np.stack(ex["attention.heads.entropy"][0]).shape == (2, 4)


# ------------------------------------------------------------------------------------ resume after a kill


def _snapshot(out: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted((out / "shards").glob("shard-*.parquet"))}


@pytest.mark.slow  # starts fresh processes
def test_resume_after_sigkill_is_identical(tmp_path, tiny):
    data = synth(tmp_path / "d.tsv", 72)
    args = ["corpus", "--data", str(data), "--model", tiny, "--shard-size", "3", "--batch-size", "2", "--quiet"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mixlens", *args, "--out", str(killed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 600  # generous: the model import alone is slow on a loaded machine
        while len(list((killed / "shards").glob("shard-*.parquet"))) < 2 and proc.poll() is None:
            assert time.time() < deadline, "corpus run made no progress"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    manifest = json.loads((killed / "manifest.json").read_text())
    assert not manifest["complete"]
    before = _snapshot(killed)
    assert 2 <= len(before) < 24

    assert cli(*args, "--out", str(killed)) == 0
    after = _snapshot(killed)
    assert all(after[name] == before[name] for name in before)  # finished shards were not recomputed
    assert len(after) == 24

    fresh = tmp_path / "fresh"
    assert cli(*args, "--out", str(fresh)) == 0
    assert {k: v[1] for k, v in _snapshot(fresh).items()} == {k: v[1] for k, v in after.items()}
    assert (fresh / "aggregate.parquet").read_bytes() == (killed / "aggregate.parquet").read_bytes()
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (fresh, killed))
    assert m2.pop("resumed_shards") == len(before) and m1.pop("resumed_shards") == 0
    assert m1 == m2 and m1["complete"] and m1["counts"]["examples"] == 72


# ------------------------------------------------------------------------------------- CLI and bad input


def test_cli_refuses_other_run_unless_overwrite(tmp_path, tiny, capsys):
    data = synth(tmp_path / "d.tsv", 5)
    base = ["corpus", "--data", str(data), "--model", tiny, "--out", str(tmp_path / "o"), "--quiet"]
    assert cli(*base, "--method", "attention") == 0
    capsys.readouterr()
    assert cli(*base, "--method", "norm") == 2
    err = capsys.readouterr().err
    assert "holds a different run" in err and "--overwrite" in err and "Traceback" not in err
    assert cli(*base, "--method", "norm", "--overwrite") == 0
    assert CorpusResult.open(tmp_path / "o").manifest["methods"] == ["norm"]


@pytest.mark.parametrize("case", ["missing_file", "missing_column", "empty_file", "unknown_method"])
def test_cli_bad_input_one_line_exit_2(tmp_path, tiny, capsys, case):
    data = synth(tmp_path / "d.tsv", 3)
    (tmp_path / "empty.tsv").write_text("")
    args = {
        "missing_file": ["--data", str(tmp_path / "nope.tsv")],
        "missing_column": ["--data", str(data), "--text-column", "review"],
        "empty_file": ["--data", str(tmp_path / "empty.tsv")],
        "unknown_method": ["--data", str(data), "--method", "nope"],
    }[case]
    assert cli("corpus", *args, "--model", tiny, "--out", str(tmp_path / "o"), "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixlens: error:") and len(err.splitlines()) == 1
    assert {
        "missing_file": "does not exist",
        "missing_column": "available columns: sentence, label",
        "empty_file": "empty",
        "unknown_method": "unknown method",
    }[case] in err


def test_cli_undecodable_lines_skipped_or_strict_keeps_finished(tmp_path, tiny, capsys):
    lines = synth(tmp_path / "d.tsv", 30).read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"".join(lines[:25] + [b"broken \xff line\t1\n"] + lines[25:]))
    base = ["corpus", "--data", str(bad), "--model", tiny, "--shard-size", "8", "--quiet"]
    assert cli(*base, "--out", str(tmp_path / "lenient")) == 0
    counts = CorpusResult.open(tmp_path / "lenient").manifest["counts"]
    assert counts["undecodable"] == 1 and counts["examples"] == 30
    capsys.readouterr()
    assert cli(*base, "--out", str(tmp_path / "strict"), "--strict") == 2
    err = capsys.readouterr().err
    assert "line 26 is not valid UTF-8" in err and "Traceback" not in err
    m = json.loads((tmp_path / "strict" / "manifest.json").read_text())
    assert not m["complete"] and m["counts"]["examples"] == 24  # 3 shards of 8 finished before the bad line
    assert len(list((tmp_path / "strict" / "shards").glob("shard-*.parquet"))) == 3


def test_cli_overlong_rows_truncated_and_counted(tmp_path, tiny, capsys):
    data = tmp_path / "long.txt"
    data.write_text("short line\n" + " ".join(["word"] * 40) + "\n")
    assert (
        cli(
            "corpus", "--data", str(data), "--model", tiny, "--out", str(tmp_path / "o"), "--max-length", "8", "--quiet"
        )
        == 0
    )
    assert "1 truncated" in capsys.readouterr().err
    res = CorpusResult.open(tmp_path / "o")
    assert res.manifest["counts"]["truncated"] == 1
    assert res.examples()["n_tokens"].tolist() == [4, 8] and res.examples()["truncated_from"].tolist() == [0, 42]


# ------------------------------------------------------------------------- resume identity and early errors


def test_resume_over_changed_file_is_refused(tmp_path, tiny, capsys):
    data = synth(tmp_path / "d.tsv", 12)
    base = [
        "corpus",
        "--data",
        str(data),
        "--model",
        tiny,
        "--out",
        str(tmp_path / "o"),
        "--shard-size",
        "4",
        "--quiet",
        "--method",
        "attention",
    ]
    assert cli(*base) == 0
    synth(data, 12, seed=1)  # same path and row count, other rows
    capsys.readouterr()
    assert cli(*base) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "changed since the run" in err and "--overwrite" in err
    assert cli(*base, "--overwrite") == 0
    texts = CorpusResult.open(tmp_path / "o").examples(["text"])["text"].tolist()
    assert texts == [e.text for e in iter_examples(data)]


def test_unchanged_file_still_resumes(tmp_path, tiny):
    data = synth(tmp_path / "d.tsv", 12)
    kw = {"model": tiny, "shard_size": 4}
    run_corpus(data, tmp_path / "o", ["attention"], **kw)
    assert run_corpus(data, tmp_path / "o", ["attention"], **kw).manifest["resumed_shards"] == 3


@pytest.mark.parametrize("case", ["header_only", "unknown_column", "max_length_0"])
def test_errors_without_model_come_first_and_leave_no_output(tmp_path, capsys, case):
    data = synth(tmp_path / "d.tsv", 3)
    (tmp_path / "head.tsv").write_text("sentence\tlabel\n")
    args = {
        "header_only": ["--data", str(tmp_path / "head.tsv")],
        "unknown_column": ["--data", str(data), "--text-column", "review"],
        "max_length_0": ["--data", str(data), "--max-length", "0"],
    }[case]
    out = tmp_path / "o"
    # a model path that cannot load: the data error must be the one reported
    assert cli("corpus", *args, "--model", str(tmp_path / "no-model"), "--out", str(out), "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-model" not in err
    assert {"header_only": "has no rows", "unknown_column": "no column 'review'", "max_length_0": "--max-length"}[
        case
    ] in err
    assert not out.exists()


def test_jsonl_lone_surrogate_row_is_skipped_and_counted(tmp_path, tiny):
    data = tmp_path / "s.jsonl"
    data.write_text('{"text": "fine one"}\n{"text": "bad \\ud800 surrogate"}\n{"text": "fine two"}\n')
    stats = ReadStats()
    assert [e.index for e in iter_examples(data, stats=stats)] == [0, 2] and stats.malformed == 1
    with pytest.raises(MixlensError, match="lone surrogate"):
        list(iter_examples(data, strict=True))
    res = run_corpus(data, tmp_path / "o", ["attention"], model=tiny)
    assert res.manifest["complete"] and res.manifest["counts"]["malformed"] == 1
    assert res.examples(["text"])["text"].tolist() == ["fine one", "fine two"]


def test_second_run_into_a_locked_out_is_refused(tmp_path, tiny, capsys):
    """#32.17: while one run holds --out (its lock), a second run into it — same or other job — is refused with one
    line naming the running one, and writes nothing; the lock goes with the run."""
    import fcntl
    import os

    from mixlens.corpus.runner import LOCK

    data = synth(tmp_path / "d.tsv", 5)
    out = tmp_path / "o"
    out.mkdir()
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"pid 4242: mixlens corpus -d other.tsv")
        for method in ("attention", "norm"):
            code = cli("corpus", "--data", str(data), "--model", tiny, "--out", str(out), "--quiet", "--method", method)
            err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
            assert code == 2 and len(err) == 1, err
            assert "in use by another mixlens corpus run (pid 4242: mixlens corpus -d other.tsv)" in err[0]
        assert sorted(p.name for p in out.iterdir()) == [LOCK]
    finally:
        os.close(fd)
    assert cli("corpus", "--data", str(data), "--model", tiny, "--out", str(out), "--quiet") == 0
    assert (out / "manifest.json").is_file()


@pytest.mark.slow  # starts fresh processes
def test_concurrent_runs_into_one_out(tmp_path, tiny):
    """#32.17: two different jobs started at once into the same --out: one finishes, the other is refused in one line
    (never two exit 0 and one manifest with shards of both)."""
    data = synth(tmp_path / "d.tsv", 40)
    out = tmp_path / "o"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mixlens",
                "corpus",
                "--data",
                str(data),
                "--model",
                tiny,
                "--out",
                str(out),
                "--quiet",
                "--method",
                method,
                "--shard-size",
                "4",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for method in ("attention", "norm")
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(c for c, _ in results)
    assert codes == [0, 2], results
    refused = next(e for c, e in results if c == 2)
    assert "in use by another mixlens corpus run (pid" in refused or "holds a different run" in refused, refused
    man = CorpusResult.open(out).manifest
    assert man["complete"] and len(man["methods"]) == 1


def test_cli_ratio_table_in_variant_order(tmp_path, tiny, capsys):
    """#32.9: the corpus summary lists the mixing-ratio variants as W, N, Res-W, Res-N, ResLN-N (not A–Z)."""
    data = synth(tmp_path / "d.tsv", 3)
    assert cli("corpus", "--data", str(data), "--model", tiny, "--out", str(tmp_path / "o"), "--method", "norm") == 0
    header = next(ln for ln in capsys.readouterr().err.splitlines() if "layer" in ln and "ResLN-N" in ln)
    cols = [c.strip() for c in header.replace("┃", "|").split("|") if c.strip()]
    assert cols == ["layer", "W", "N", "Res-W", "Res-N", "ResLN-N"]


def test_a_folder_holding_another_files_run_says_so(tmp_path, tiny, capsys):
    """#45 item 24: a run of B.tsv into a folder holding A.tsv's run said "B.tsv changed since the run began"."""
    a, b = synth(tmp_path / "A.tsv", 8), synth(tmp_path / "B.tsv", 8, seed=1)
    base = ["corpus", "--model", tiny, "--out", str(tmp_path / "o"), "--shard-size", "4", "--quiet"]
    assert cli(*base, "--data", str(a), "--method", "attention") == 0
    capsys.readouterr()
    assert cli(*base, "--data", str(b), "--method", "attention") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "changed since" not in err, err
    assert "holds a different run" in err and "A.tsv" in err and "B.tsv" in err, err


def test_a_bad_row_is_named_by_its_line_in_the_file(tmp_path):
    """#45 item 24: the TSV reader counted lines from after the header (and without undecodable lines), so it
    named the wrong line."""
    path = tmp_path / "d.tsv"
    path.write_bytes(b"\n" + b"sentence\tlabel\n" + b"a fine film\t1\n" + b"caf\xe9\t0\n" + b"one\ttwo\tthree\n")
    skipped: list[str] = []
    rows = list(iter_examples(path, on_skip=lambda kind, where: skipped.append(where)))
    assert [r.text for r in rows] == ["a fine film"]
    assert skipped == ["line 4 is not valid UTF-8", "line 5 has 3 fields, the header 2"], skipped
