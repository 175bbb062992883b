"""Hostile input on every command (issues #13–#16, "Bad input"): one line on stderr, exit code 2, nothing written.

`BASE` holds a valid invocation of every command of `mixlens --help`; the generic cases put one bad value into it
(a missing or unsupported model, a GGUF file that is not there), the specific cases exercise each command's own
inputs. A new command without an entry in `BASE` fails `test_every_command_is_covered`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import pytest
import typer

from mixlens.errors import MixlensError
from tests.conftest import run_cli

STS_ROWS = [
    ("a cat sits on the mat", "a cat sat on a mat", "4.5"),
    ("the dog runs home", "the sky is blue today", "0.4"),
    ("he eats an apple", "she eats an apple", "3.2"),
    ("a red car", "a blue car", "2.6"),
] * 6  # 24 pairs: prune's two splits hold at least 10 each

CONLLU = """# text = The cat sleeps.
1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_
2\tcat\tcat\tNOUN\tNN\t_\t3\tnsubj\t_\t_
3\tsleeps\tsleep\tVERB\tVBZ\t_\t0\troot\t_\t_
4\t.\t.\tPUNCT\t.\t_\t3\tpunct\t_\t_

# text = Dogs bark loudly.
1\tDogs\tdog\tNOUN\tNNS\t_\t2\tnsubj\t_\t_
2\tbark\tbark\tVERB\tVBP\t_\t0\troot\t_\t_
3\tloudly\tloudly\tADV\tRB\t_\t2\tadvmod\t_\t_
4\t.\t.\tPUNCT\t.\t_\t2\tpunct\t_\t_

"""


@pytest.fixture
def fx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Input files in tmp_path (also the working directory); `out` is a path that does not exist yet."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.tsv").write_text("sentence\tlabel\na fine film\t1\na dull movie\t0\nso so\t1\n")
    (tmp_path / "sts.tsv").write_text("sentence1\tsentence2\tscore\n" + "".join("\t".join(r) + "\n" for r in STS_ROWS))
    (tmp_path / "ud.conllu").write_text(CONLLU)
    (tmp_path / "empty.tsv").write_text("")
    (tmp_path / "header.tsv").write_text("sentence\tlabel\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "badmodel").mkdir()
    (tmp_path / "badmodel" / "config.json").write_text(json.dumps({"model_type": "foobar", "hidden_size": 8}))
    (tmp_path / "ggdir").mkdir()
    (tmp_path / "ggdir" / "a.gguf").write_bytes(b"")
    word_out = {"words": ["the", "cat"], "pairs": [{"from": 0, "to": 7, "relation": "det"}]}
    (tmp_path / "rel_index.jsonl").write_text(json.dumps(word_out) + "\n")
    no_words = {"text": "the cat sat", "pairs": [{"from": "dog", "to": "cat", "relation": "nsubj"}]}
    (tmp_path / "rel_words.jsonl").write_text(json.dumps(no_words) + "\n")
    return {p.stem: str(p) for p in tmp_path.iterdir()} | {"out": str(tmp_path / "out"), "dir": str(tmp_path)}


# A valid invocation of every command ({name}: a file of `fx`).
BASE: dict[str, list[str]] = {
    "analyze": ["analyze", "hi there"],
    "methods": ["methods"],
    "families": ["families"],
    "corpus": ["corpus", "-d", "{good}", "-o", "{out}"],
    "report": ["report", "hi there", "-o", "{out}/r.html"],
    "plot": ["plot", "hi there", "-o", "{out}/p.png"],
    "serve": ["serve", "--port", "0"],
    "heads": ["heads", "-d", "{good}", "-o", "{out}"],
    "head-diff": ["head-diff", "-d", "{good}", "--other", "{good}", "-o", "{out}"],
    "syntax": ["syntax", "-d", "{ud}", "-o", "{out}"],
    "patterns": ["patterns", "-d", "{good}", "-o", "{out}"],
    "sweep": ["sweep", "-d", "{sts}", "-o", "{out}"],
    "prune": ["prune", "-d", "{sts}", "-o", "{out}"],
    "ablate-patterns": ["ablate-patterns", "-d", "{sts}", "-o", "{out}"],
    "compare-local-global": ["compare-local-global", "{good}", "-o", "{out}/lg.json"],
    "saliency": ["saliency", "hi there"],
    "relations": ["relations", "--from-conllu", "{ud}", "-o", "{out}"],
    "frequency": ["frequency", "-d", "{good}", "-o", "{out}"],
    "identify": ["identify", "-d", "{good}", "-o", "{out}"],
    "explain": ["explain", "hi there"],
    "evaluate": ["evaluate", "--data", "{good}", "-o", "{out}"],
}


def command_options() -> dict[str, set[str]]:
    from mixlens.cli import app

    cmd = typer.main.get_command(app)
    return {name: {o for p in c.params for o in p.opts} for name, c in cmd.commands.items()}


def check_one_line(argv: list[str], fx: dict[str, str], capsys: pytest.CaptureFixture[str], message: str) -> None:
    """`mixlens ARGV` fails with one line containing `message`, exit code 2, and writes nothing."""
    root = Path(fx["dir"])
    before = sorted(root.rglob("*"))
    code, _, err = run_cli([a.format(**fx) for a in argv], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert message in lines[0], lines[0]
    assert sorted(root.rglob("*")) == before, "wrote files"


def test_every_command_is_covered():
    assert set(BASE) == set(command_options())


def test_every_model_command_takes_gguf_file():
    missing = [name for name, opts in command_options().items() if "--model" in opts and "--gguf-file" not in opts]
    assert missing == []


GENERIC = [
    (["--model", "/definitely/not/here"], "model path '/definitely/not/here' does not exist"),
    (["--model", "{afile}"], "is not a Hugging Face model directory"),
    (["--model", "{badmodel}"], "unsupported architecture 'foobar'; supported model types: "),
    (["--model", "{ggdir}", "--gguf-file", "b.gguf"], "no GGUF file 'b.gguf' in"),
    (["--gguf-file", "a.gguf"], "a GGUF file needs its folder: give --model DIR"),
]


@pytest.mark.parametrize("extra, message", GENERIC, ids=["missing", "file", "family", "gguf", "gguf-alone"])
@pytest.mark.parametrize("command", sorted(n for n, o in command_options().items() if "--model" in o))
def test_bad_model_on_every_command(command, extra, message, fx, capsys):
    check_one_line([*BASE[command], *extra], fx, capsys, message)


SPECIFIC = [
    # analyze
    (["analyze", ""], "input 1 is empty or whitespace only"),
    (["analyze", "\u200b\u200c"], "input 1 is empty or whitespace only"),
    (["analyze", "hi", "--method", "bogus"], "unknown method 'bogus'"),
    (["analyze", "hi", "--max-length", "0"], "Input should be greater than or equal to 1"),
    (["analyze", "hi", "--max-length", "1"], "max_length 1 is too short"),
    (["analyze", "hi", "--rows", "99"], "row position 99 is outside input 1"),
    (["analyze", "hi", "--rows", "x"], "--rows must be last, all or comma-separated integer positions"),
    (["analyze", "hi", "--option", "norm.bogus=1"], "method 'norm' has no option 'bogus'"),
    (["analyze", "hi", "-o", "{afile}/sub/a.json"], "cannot write"),
    (["analyze", "hi", "-o", "{adir}"], "is a directory"),
    # methods
    (["methods", "--bogus"], "No such option"),
    (["families", "--bogus"], "No such option"),
    (["analyze", "hi", "--family", "nope"], "unknown family 'nope'; families: bert"),
    # corpus
    (["corpus", "-d", "/no/data.tsv", "-o", "{out}"], "does not exist"),
    (["corpus", "-d", "{adir}", "-o", "{out}"], "adir"),
    (["corpus", "-d", "{empty}", "-o", "{out}"], "empty"),
    (["corpus", "-d", "{header}", "-o", "{out}"], "has no rows"),
    (["corpus", "-d", "{good}", "-o", "{out}", "--method", "bogus"], "unknown method 'bogus'"),
    (["corpus", "-d", "{good}", "-o", "{out}", "--max-length", "0"], "Input should be greater than or equal to 1"),
    (["corpus", "-d", "{good}", "-o", "{out}", "--max-length", "1"], "max_length 1 is too short"),
    (["corpus", "-d", "{good}", "-o", "{out}", "--workers", "0"], "--workers must be at least 1"),
    (["corpus", "-d", "{good}", "-o", "{out}", "--store", "bogus"], "unknown --store 'bogus'"),
    (["corpus", "-d", "{good}", "-o", "{afile}/sub"], "is not a directory"),
    (["corpus", "-d", "{good}", "-o", "{afile}"], "exists and is not a directory"),
    # report, plot, serve
    (["report", "", "-o", "{out}/r.html"], "input 1 is empty or whitespace only"),
    (["report", "hi", "-o", "{out}/r.txt"], "--out must end in .html"),
    (["report", "hi", "-o", "{out}/r.html", "--method", "bogus"], "unknown method 'bogus'"),
    (["report", "--from", "{afile}", "-o", "{out}/r.html"], "afile"),
    (["report", "hi", "-o", "{afile}/sub/r.html"], "cannot write"),
    (["plot", "hi", "-o", "{out}/p.txt"], "--out must end in .png, .svg or .pdf"),
    (["plot", "hi", "-o", "{out}/p.png", "--layer", "99"], "layer 99 out of range"),
    (["plot", "hi", "-o", "{out}/p.png", "--method", "bogus"], "unknown method 'bogus'"),
    (["plot", "hi", "-o", "{out}/p.png", "--max-length", "0"], "Input should be greater than or equal to 1"),
    (["serve", "--method", "bogus"], "unknown method 'bogus'"),
    (["serve", "--port", "99999"], "Input should be less than or equal to 65535"),
    # dataset commands
    (["heads", "-d", "/no/data.tsv", "-o", "{out}"], "does not exist"),
    (["heads", "-d", "{good}", "-o", "{out}", "--view", "bogus"], "unknown view 'bogus'"),
    (["heads", "-d", "{good}", "-o", "{afile}/sub"], "cannot write"),
    (["head-diff", "-d", "{good}", "--other", "/no/model", "-o", "{out}"], "does not exist"),
    (["syntax", "-d", "{empty}", "-o", "{out}"], "holds no sentences"),
    (["syntax", "-d", "{good}", "-o", "{out}"], "CoNLL-U needs 10"),
    (["syntax", "-d", "{ud}", "-o", "{out}", "--view", "bogus"], "unknown view 'bogus'"),
    (["patterns", "-d", "{header}", "-o", "{out}"], "has no rows"),
    (["patterns", "-d", "{good}", "-o", "{out}", "--view", "bogus"], "unknown view 'bogus'"),
    (["sweep", "-d", "{sts}", "-o", "{out}", "--disable", "L9H99"], "L9H99"),
    (["sweep", "-d", "{sts}", "-o", "{out}", "--disable", "L0H99"], "L0H99"),
    (["sweep", "-d", "{sts}", "-o", "{out}", "--mode", "bogus"], "unknown ablation mode 'bogus'"),
    (["sweep", "-d", "{sts}", "-o", "{out}", "--metric", "bogus"], "unknown metric 'bogus'"),
    (["sweep", "-d", "{good}", "-o", "{out}", "--metric", "sts"], "the sts metric needs sentence pairs"),
    (["prune", "-d", "{sts}", "-o", "{out}", "--disable", "L9H99"], "L9H99"),
    (["prune", "-d", "{good}", "-o", "{out}", "--metric", "accuracy"], "too small to confirm a pruning"),
    (["ablate-patterns", "-d", "{sts}", "-o", "{out}", "--disable", "L0H99"], "L0H99"),
    (["ablate-patterns", "-d", "{sts}", "-o", "{out}", "--mode", "bogus"], "bogus"),
    (["compare-local-global", "/no/data.tsv"], "does not exist"),
    (["compare-local-global", "{adir}"], "is a directory; give a file"),
    (["compare-local-global", "{good}", "--mode", "bogus"], "unknown mode 'bogus'"),
    (["compare-local-global", "{good}", "-o", "{adir}"], "is a directory"),
    (["saliency", ""], "input 1 is empty or whitespace only"),
    (["saliency", "hi", "--kind", "bogus"], "bogus"),
    (["relations", "--data", "{rel_index}", "-o", "{out}"], "rel_index.jsonl: line 1"),
    (["relations", "--data", "{rel_words}", "-o", "{out}"], "rel_words.jsonl: line 1"),
    (["relations", "-o", "{out}"], "give exactly one of --data (relation JSONL) and --from-conllu"),
    (["frequency", "-d", "{empty}", "-o", "{out}"], "empty"),
    (["frequency", "-d", "{good}", "-o", "{out}", "--lang", "xx-bogus"], "wordfreq has no word list for language"),
    (["identify", "-d", "{good}", "-o", "{out}", "--probe", "bogus"], "bogus"),
    (["explain", ""], "empty"),
    (["explain", "hi", "--format", "bogus"], "unknown format 'bogus'"),
    (["explain", "hi", "--generate", "2"], "--generate"),
    (["explain", "hi", "--method", "saliency", "--method", "deeplift", "-o", "{afile}/sub/e.json"], "cannot write"),
    (["evaluate", "--data", "{empty}", "-o", "{out}"], "empty"),
    (["evaluate", "--data", "{good}", "-o", "{out}", "--removal", "bogus"], "unknown removal 'bogus'"),
    (["evaluate", "--data", "{good}", "-o", "{afile}/sub", "--method", "saliency", "--limit", "2"], "cannot write"),
]


@pytest.mark.parametrize("argv, message", SPECIFIC, ids=[f"{k}-{a[0]}" for k, (a, _) in enumerate(SPECIFIC)])
def test_bad_input(argv, message, fx, capsys):
    check_one_line(argv, fx, capsys, message)


def test_specific_cases_cover_every_command():
    assert {argv[0] for argv, _ in SPECIFIC} == set(BASE)


# ---- issue 32: target rows in the table, round trips, crafted analyses, locked corpus dirs, failing writes ----


@pytest.mark.parametrize("method", ["norm", "alti"])
def test_analyze_table_shows_rows(method, fx, capsys):
    """#32.10: `analyze TEXT --method M --rows 0` printed an IndexError after writing its JSON."""
    code, out, err = run_cli(["analyze", "the cat sat", "--method", method, "--rows", "0"], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert f"{method}: top 3 sources of target row 0" in out and "0: [CLS]" in out
    saved = json.loads((Path(fx["dir"]) / "mixlens-analysis.json").read_text())
    assert saved["inputs"][0]["methods"][method]["rows"] == [0]


def test_analyze_long_decoder_default_rows(tmp_path, tokenizer, fx, capsys):
    """#32.10: a causal LM over 512 tokens defaults to the last row; the table printed an IndexError after the JSON
    was written."""
    from tests.conftest import random_model

    model = tmp_path / "gpt"
    random_model("gpt2", tokenizer, n_positions=1024).save_pretrained(model)
    tokenizer.save_pretrained(model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 1024}))
    text = " ".join(["word"] * 600)
    code, out, err = run_cli(["analyze", text, "--model", str(model), "--method", "norm"], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert "top 3 sources of target row 601" in out
    saved = json.loads((Path(fx["dir"]) / "mixlens-analysis.json").read_text())
    assert saved["inputs"][0]["methods"]["norm"]["rows"] == [601]


def test_one_long_decoder_input_shows_a_bar_of_layers(tmp_path, tokenizer, fx, capsys, monkeypatch):
    """#33.5: one long input of a causal LM shows its progress in layers on a terminal (forward pass, then the
    rollout's row propagation), and nothing on a pipe."""
    from tests.conftest import random_model

    model = tmp_path / "gpt"
    random_model("gpt2", tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    argv = ["analyze", "the cat sat on the mat", "--model", str(model), "--method", "globenc_rollout"]
    argv += ["--rows", "last", "-f", "json", "-o", fx["out"] + ".json"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0 and "layers" not in err, err
    import rich.progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    seen: list[str] = []

    update = rich.progress.Progress.update
    monkeypatch.setattr(
        rich.progress.Progress,
        "update",
        lambda self, task, **kw: (seen.append(self.tasks[0].description), update(self, task, **kw))[1],
    )
    code, _, err = run_cli(argv, capsys)
    assert code == 0 and "Traceback" not in err, err
    assert seen.count("forward pass") == 2 and seen.count("propagating the target rows") == 2  # 2 layers each


def test_analyze_rows_json_round_trips(fx, capsys):
    """#32 D: the JSON of `analyze --rows` is read back by `Analysis.load` and `report --from`."""
    from mixlens.result import Analysis

    dest = Path(fx["dir"]) / "a.json"
    argv = ["analyze", "the cat sat", "a dog barked", "--method", "norm", "--method", "alti", "--rows", "0,-1"]
    assert run_cli([*argv, "-f", "json", "-o", str(dest)], capsys)[0] == 0
    res = Analysis.load(dest)
    assert res["norm"].rows == [[0, 4], [0, 4]] and res["alti"].input(1).shape[-2:] == (2, 5)
    assert json.dumps(res.to_json()) == dest.read_text()  # exactly what was written
    code, _, err = run_cli(["report", "--from", str(dest), "-o", fx["out"] + ".html"], capsys)
    assert code == 0, err
    page = Path(fx["out"] + ".html").read_text()
    assert "holds only target rows" in page and "target 4" in page


def _analysis_json(**changes: object) -> dict:
    one = {
        "text": "a b",
        "tokens": ["[CLS]", "a", "b", "[SEP]"],
        "methods": {"norm": {"dims": ["layer", "target", "source"], "values": [[[0.25] * 4] * 4] * 2}},
        "mixing_ratio": {"W": [0.5, 0.6]},
        "reconstruction_error": 0.0,
    }
    return {"model": "m", "version": "0", "inputs": [{**one, **changes}]}


CRAFTED = {
    "float-targets": (
        _analysis_json(
            methods={"norm": {"dims": ["layer", "target", "source"], "values": [[[0.25] * 4]] * 2, "targets": [0.0]}}
        ),
        "'targets' must list distinct integer token positions",
    ),
    "target-outside": (
        _analysis_json(
            methods={"norm": {"dims": ["layer", "target", "source"], "values": [[[0.25] * 4]] * 2, "targets": [9]}}
        ),
        "'targets' must list distinct integer token positions",
    ),
    "float-rows": (
        _analysis_json(
            methods={"norm": {"dims": ["layer", "target", "source"], "values": [[[0.25] * 4]] * 2, "rows": [0.0]}}
        ),
        "'rows' must list distinct integer token positions",
    ),
    "row-outside": (  # files of earlier versions ('targets') and of this one ('rows') are checked the same way
        _analysis_json(
            methods={"norm": {"dims": ["layer", "target", "source"], "values": [[[0.25] * 4]] * 2, "rows": [9]}}
        ),
        "'rows' must list distinct integer token positions",
    ),
    "ratio-layers": (_analysis_json(mixing_ratio={"W": [0.5, 0.6, 0.7]}), "different layer counts"),
    "string-values": (
        _analysis_json(methods={"norm": {"dims": ["layer", "target", "source"], "values": "abc"}}),
        "not a regular array of numbers",
    ),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_report_from_crafted_json_is_refused(case, fx, capsys):
    """#32.18: `report --from` validates a crafted analysis (one line, exit 2, nothing written)."""
    obj, message = CRAFTED[case]
    (Path(fx["dir"]) / "crafted.json").write_text(json.dumps(obj))
    check_one_line(["report", "--from", "{dir}/crafted.json", "-o", "{out}/r.html"], fx, capsys, message)


@pytest.mark.parametrize("what", ["index", "ratio-layers"])
def test_report_from_crafted_saved_analysis_is_refused(what, bundled, fx, capsys):
    """#32.18: a saved analysis whose index tensors are floats, or whose mixing ratios have another layer count than
    its maps, is refused by `Analysis.load` and so by `report --from`."""
    from safetensors.numpy import load, save

    from mixlens.result import SAVE_ID

    base = Path(fx["dir"]) / "saved"
    bundled.analyze(["the cat sat"], ["norm"]).save(base)
    st = base.with_suffix(".safetensors")
    tensors = load(st.read_bytes())
    if what == "index":
        tensors["method.norm.index.0"] = tensors["method.norm.index.0"].astype("float32")
        message = "no list of input numbers"
    else:
        tensors["ratio.W.values.0"] = tensors["ratio.W.values.0"][:, :-1]
        message = "mixing ratio 'W' has 5"
    save_id = json.loads(base.with_suffix(".json").read_text())["save_id"]
    st.write_bytes(save(tensors, metadata={SAVE_ID: save_id}))
    check_one_line(["report", "--from", str(base.with_suffix(".json")), "-o", "{out}/r.html"], fx, capsys, message)


def test_report_from_json_declaring_many_tokens_and_layers(fx, capsys):
    """#32 D: a small file declaring 200,000 tokens and 20,000 layers of mixing ratios made `report --from` allocate
    16 GB (each mean repeated on every token); the means are kept as they are. More than `MAX_LAYERS` layers (#45
    item 14) are refused."""
    from mixlens.result.validation import MAX_LAYERS

    obj = _analysis_json(tokens=["x"] * 200_000, methods={}, mixing_ratio={"W": [0.5] * MAX_LAYERS})
    (Path(fx["dir"]) / "big.json").write_text(json.dumps(obj))
    code, _, err = run_cli(["report", "--from", "{dir}/big.json".format(**fx), "-o", fx["out"] + ".html"], capsys)
    assert code == 0, err
    assert "first 256 of 200000 tokens" in Path(fx["out"] + ".html").read_text()
    obj = _analysis_json(tokens=["x"] * 200_000, methods={}, mixing_ratio={"W": [0.5] * 20_000})
    (Path(fx["dir"]) / "big.json").write_text(json.dumps(obj))
    check_one_line(["report", "--from", "{dir}/big.json", "-o", "{out}.html"], fx, capsys, "at most 1024")


@pytest.mark.parametrize("command", ["analyze", "report", "explain"])
def test_unwritable_out_is_found_before_the_work(command, fx, capsys, monkeypatch):
    """#32.16/D: an --out that cannot be written is refused before the model loads."""
    import mixlens.lens

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mixlens.lens, "load", no_load)
    name = "a.json" if command == "analyze" else "r.html"
    check_one_line([command, "hi", "-o", "{afile}/sub/" + name], fx, capsys, "is not a directory")
    monkeypatch.setattr("os.access", lambda *a, **k: False)
    check_one_line([command, "hi", "-o", "{adir}/" + name], fx, capsys, "no permission to write in")


@pytest.mark.parametrize("argv", [["analyze", "hi", "-o", "{out}.json"], ["report", "hi", "-o", "{out}.html"]])
def test_full_disk_is_one_line(argv, fx, capsys, monkeypatch):
    """#32.16: a write that fails at flush/fsync (a full disk) is one line and exit 2, never 'wrote …' with exit 0;
    no file (not even the temp file) is left."""
    import errno
    import os

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    check_one_line(argv, fx, capsys, "No space left on device")


def test_stdout_on_a_full_disk_is_one_line(fx, capsys, monkeypatch):
    """#32.16: JSON/CSV to stdout on a full disk (here /dev/full) is a one-line error, not a lost result."""
    import sys

    from mixlens.commands.output import write_stdout
    from mixlens.errors import MixlensError

    full = Path("/dev/full").open("w")  # noqa: SIM115 (closed below, whatever the buffer still holds)
    try:
        monkeypatch.setattr(sys, "stdout", full)
        with pytest.raises(MixlensError, match="cannot write to stdout: No space left on device"):
            write_stdout("x" * 100_000)
    finally:
        monkeypatch.undo()
        with contextlib.suppress(OSError):
            full.close()


# ---- issue 32: untrusted JSON (items 13, 14) and model folders that are not what they claim (items 12, 15) ----

DEEP = "[" * 100_000 + "]" * 100_000  # past Python's recursion limit


def _write(fx: dict[str, str], name: str, data: str | bytes) -> str:
    p = Path(fx["dir"]) / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(p)


@pytest.mark.parametrize(
    "manifest, message",
    [
        (DEEP, "nested too deeply"),
        ("[1, 2]", "is not a JSON object (it holds a JSON list)"),
        (b'{"format": "\xff"}', "is not UTF-8 text"),
    ],
    ids=["deep", "list", "latin1"],
)
def test_corpus_manifest_that_is_not_a_json_object(manifest, message, fx, capsys):
    """#32.13: RecursionError / AttributeError / UnicodeDecodeError tracebacks on a crafted corpus manifest."""
    man = Path(_write(fx, "run/manifest.json", manifest))
    before = man.read_bytes()
    code, _, err = run_cli(["corpus", "-d", fx["good"], "-o", str(man.parent)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert str(man) in err and message in err and "use --overwrite" in err, err
    assert man.read_bytes() == before and not (man.parent / "shards").exists()


def test_deeply_nested_jsonl_row_and_saved_analysis(fx, capsys):
    """#32.13: a deeply nested JSONL data row and a saved analysis given to `report --from`."""
    rows = _write(fx, "deep.jsonl", '{"text": ' + DEEP + "}\n")
    check_one_line(["corpus", "-d", rows, "-o", "{out}"], fx, capsys, "line 1 is not readable JSON: nested too deep")
    saved = _write(fx, "deep.json", '{"inputs": ' + DEEP + "}")
    check_one_line(["report", "--from", saved, "-o", "{out}/r.html"], fx, capsys, "nested too deeply")
    listed = _write(fx, "list.json", "[]")
    check_one_line(["report", "--from", listed, "-o", "{out}/r.html"], fx, capsys, "is not a JSON object")


@pytest.mark.parametrize(
    "data, message",
    [
        ('{"words": ["a", "b"], "pairs": [{"from": ' + "9" * 5000 + ', "to": 1, "relation": "x"}]}\n', "digits"),
        (b'{"words": ["caf\xe9", "b"], "pairs": []}\n', "is not UTF-8 text"),
        ('{"words": ' + DEEP + "}\n", "nested too deeply"),
    ],
    ids=["5000-digits", "latin1", "deep"],
)
def test_relations_pairs_file_that_python_cannot_read(data, message, fx, capsys):
    """#32.14: ValueError (int-string limit) and UnicodeDecodeError tracebacks from the pairs file."""
    pairs = _write(fx, "pairs.jsonl", data)
    check_one_line(["relations", "--data", pairs, "-o", "{out}"], fx, capsys, "pairs.jsonl: line 1")
    check_one_line(["relations", "--data", pairs, "-o", "{out}"], fx, capsys, message)


def test_a_byte_order_mark_is_accepted_by_the_json_readers(tmp_path):
    """#32.14: a UTF-8 BOM at the start of a JSONL or JSON file was "not valid JSON"."""
    from mixlens import jsonio
    from mixlens.bertology.relations import read_relations
    from mixlens.corpus.readers import iter_examples

    bom = b"\xef\xbb\xbf"
    rel = tmp_path / "r.jsonl"
    rel.write_bytes(bom + b'{"words": ["the", "cat"], "pairs": [{"from": 0, "to": 1, "relation": "det"}]}\n')
    assert read_relations(rel)[0].words == ["the", "cat"]
    rows = tmp_path / "d.jsonl"
    rows.write_bytes(bom + b'{"text": "one"}\n{"text": "two"}\n')
    assert [e.text for e in iter_examples(rows, strict=True)] == ["one", "two"]
    doc = tmp_path / "m.json"
    doc.write_bytes(bom + b'{"a": 1}')
    assert jsonio.read(doc) == {"a": 1}


def _model_dir(fx: dict[str, str], tokenizer, name: str) -> Path:
    from tests.conftest import random_model

    d = Path(fx["dir"]) / name
    random_model("bert", tokenizer).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def test_model_folder_with_a_truncated_checkpoint_or_a_nested_config(fx, tokenizer, capsys):
    """#32.15: a truncated model.safetensors or a deeply nested config.json gave a traceback."""
    d = _model_dir(fx, tokenizer, "m")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    check_one_line(["analyze", "hi", "--model", str(d)], fx, capsys, f"cannot load model '{d}'")
    (d / "config.json").write_text('{"model_type": ' + DEEP + "}")
    check_one_line(["analyze", "hi", "--model", str(d)], fx, capsys, "config.json is not readable JSON: nested too")


@pytest.mark.parametrize("gguf_file", ["../x.gguf", "/etc/passwd", "sub/../../x.gguf"])
def test_gguf_file_outside_the_model_folder_is_refused(gguf_file, fx, capsys):
    """#32 D: `--gguf-file ../x.gguf` or an absolute path was opened."""
    _write(fx, "x.gguf", b"GGUF")
    check_one_line(
        ["analyze", "hi", "--model", "{ggdir}", "--gguf-file", gguf_file], fx, capsys, "is outside the --model folder"
    )


def test_model_folder_holding_only_a_gguf_suggests_gguf_file(fx, capsys):
    """#32.9: "no config.json" without a word about --gguf-file."""
    check_one_line(
        ["analyze", "hi", "--model", "{ggdir}"],
        fx,
        capsys,
        "no config.json); it holds GGUF files: give --gguf-file a.gguf",
    )


CORRUPT_GGUF = [
    ("empty", b""),
    ("truncated", b"GGUF\x03\x00\x00\x00\x05"),  # struct.error inside the gguf reader
    ("not-gguf", b"hello world" * 10),
]


@pytest.mark.parametrize("kind, data", CORRUPT_GGUF, ids=[k for k, _ in CORRUPT_GGUF])
@pytest.mark.parametrize("command", ["analyze", "explain", "evaluate", "corpus"])
def test_corrupt_gguf_file_is_one_line(command, kind, data, fx, capsys):
    """#32.12: a truncated or corrupt GGUF gave a struct.error traceback in analyze, explain, evaluate, corpus."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    _write(fx, "ggdir/bad.gguf", data)
    argv = [*BASE[command], "--model", "{ggdir}", "--gguf-file", "bad.gguf"]
    check_one_line(argv, fx, capsys, "cannot read the GGUF file")
    check_one_line(argv, fx, capsys, "bad.gguf")


# ---- issue 32 A4, D: progress with an estimate, what was dropped or cut, NaN, Ctrl-C, save-pairs ----


def _tty(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)


PROGRESS = [
    (["explain", "hi there", "a fine film", "--method", "saliency", "-f", "json"], "explain"),
    (["evaluate", "--data", "{good}", "-o", "{out}", "--method", "saliency", "-f", "json"], "evaluate"),
    (["compare-local-global", "{good}", "-o", "{out}/lg.json", "--limit", "2"], "compare-local-global"),
]


@pytest.mark.parametrize("argv, what", PROGRESS, ids=[a[0] for a, _ in PROGRESS])
def test_progress_with_an_estimate_on_a_terminal_only(argv, what, fx, capsys, monkeypatch):
    """#32.4: explain was silent, evaluate printed a bare count, compare-local-global sat at 0/8 -:--:--."""
    argv = [a.format(**fx) for a in argv]
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and what not in err and "eta" not in err, err  # piped: no bar
    _tty(monkeypatch)
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and what in err and "eta" in err, err
    if "json" in argv:
        json.loads(out)  # never into the JSON


def test_progress_advances_inside_a_batch(bundled):
    """#32.4: per method / JVP chunk, not per batch of 8: the parts add up to the inputs."""
    from mixlens.explain import explain
    from mixlens.explain.evaluate import evaluate
    from mixlens.stats.agreement import compare_local_global

    texts = ["a fine film", "a dull movie", "so so"]
    parts: list[float] = []
    explain(bundled, texts, ["saliency", "attention"], progress=parts.append)
    assert len(parts) == 2 and sum(parts) == pytest.approx(3)
    seen: list[tuple[float, int]] = []
    evaluate(bundled, texts, ["saliency"], progress=lambda d, t: seen.append((d, t)))
    assert len(seen) == 3 and seen[-1] == (pytest.approx(3), 3)  # saliency, reference, perturbed passes
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    parts.clear()
    compare_local_global(bundled, texts, batch_size=2, on_batch=parts.append)
    assert len(parts) >= 4 and sum(parts) == pytest.approx(3)  # 2 batches: each JVP chunk, then the rest


def test_evaluate_says_what_it_dropped_and_cut(fx, capsys):
    """#32 D: records with bad UTF-8 or a lone surrogate were dropped silently; an over-long input was cut while
    evaluation.json kept its whole text."""
    d = Path(fx["dir"])
    long = " ".join(["word"] * 700)
    (d / "rows.jsonl").write_bytes(
        b'{"text": "a fine film"}\n{"text": "caf\xe9"}\n{"text": "bad \\ud800 one"}\n'
        + json.dumps({"text": long}).encode()
        + b"\n"
    )
    argv = ["evaluate", "--data", str(d / "rows.jsonl"), "-o", fx["out"], "--method", "saliency", "-f", "json"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "line 2 is not valid UTF-8; record skipped" in err and "lone surrogate" in err
    assert "warning: input 2 truncated from" in err
    notes = json.loads(out)["notes"]
    assert any(n.startswith("skipped 2 unreadable records") and "line 2" in n for n in notes), notes
    assert any(n.startswith("truncated to the model's limit") and "input 2 " in n for n in notes), notes


def test_evaluate_nan_metric_is_null_and_noted(fx, capsys):
    """#32 D: a one-token text gave NaN in evaluation.json (not JSON) and exit 0 without a word."""
    d = Path(fx["dir"])
    (d / "one.txt").write_text("hi\nyes\n")
    argv = ["evaluate", "--data", str(d / "one.txt"), "-o", fx["out"], "--method", "saliency"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err

    def no_nan(c: str) -> None:
        raise AssertionError(f"{c} in JSON")

    doc = json.loads((Path(fx["out"]) / "evaluation.json").read_text(), parse_constant=no_nan)
    assert doc["metrics"]["saliency"]["spearman_gxi"] is None
    assert any("spearman_gxi undefined" in n for n in doc["notes"])
    assert "note: saliency: spearman_gxi undefined" in out
    from mixlens.explain.evaluate import Evaluation

    again = Evaluation.from_json(doc)  # null reads back as nan
    assert json.loads(again.dumps())["notes"] == doc["notes"]


def test_prune_json_has_no_nan(fx, capsys, monkeypatch):
    """#32 D: prune.json could hold NaN."""
    import mixlens.bertology.prune as cmd

    real = cmd.prune

    def nan_prune(*a, **k):
        res = real(*a, **k)
        res.heldout_score = float("nan")  # e.g. a correlation over constant scores
        return res

    monkeypatch.setattr(cmd, "prune", nan_prune)
    code, out, err = run_cli([*(a.format(**fx) for a in BASE["prune"]), "--max-heads", "1"], capsys)
    assert code == 0, err
    doc = json.loads((Path(fx["out"]) / "prune.json").read_text(), parse_constant=lambda c: 1 / 0)
    assert doc["heldout_score"] is None and "heldout_score" in doc["notes"][0] and "note: not a number" in out


def test_evaluate_ctrl_c_keeps_finished_examples_and_resumes(fx, capsys, monkeypatch):
    """#32 D: Ctrl-C ended evaluate with exit 130 and nothing kept; the same command now resumes."""
    import mixlens.explain.scoring as ev_mod

    d = Path(fx["dir"])
    (d / "four.txt").write_text("a fine film\na dull movie\nso so\nwhat a ride\n")
    argv = ["evaluate", "--data", str(d / "four.txt"), "-o", fx["out"], "--method", "saliency", "--batch-size", "2"]
    code, _, _ = run_cli([*argv[:4], str(d / "whole"), *argv[5:]], capsys)
    whole = json.loads((d / "whole" / "evaluation.json").read_text())
    real, calls = ev_mod.perturbed_f, []

    def stop_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ev_mod, "perturbed_f", stop_second)
    code, _, err = run_cli(argv, capsys)
    assert code == 130 and "kept 2 of 4 examples" in err and "Resume with the same command" in err, err
    assert len(err.strip().splitlines()) == 1
    part = json.loads((Path(fx["out"]) / "evaluation.json").read_text())
    assert part["interrupted"] == {"examples": 2, "of": 4} and len(part["examples"]) == 2
    monkeypatch.setattr(ev_mod, "perturbed_f", real)
    code, _, err = run_cli(argv, capsys)
    assert code == 0 and "resuming the interrupted evaluation" in err, err
    done = json.loads((Path(fx["out"]) / "evaluation.json").read_text())
    assert "interrupted" not in done and done["examples"] == whole["examples"]  # as one uninterrupted run
    assert done["metrics"] == whole["metrics"]


def test_evaluate_killed_without_warning_resumes_from_its_checkpoint(fx, capsys, monkeypatch):
    """A run killed with no chance to save (SIGKILL, a lost machine; here: an error in the third batch that is not
    Ctrl-C) keeps the batches saved by its periodic checkpoint; the same command resumes after them and ends as
    one uninterrupted run."""
    import mixlens.explain.checkpoint as ckpt_mod
    import mixlens.explain.scoring as ev_mod

    d = Path(fx["dir"])
    (d / "six.txt").write_text("a fine film\na dull movie\nso so\nwhat a ride\nnot good\ngreat fun\n")
    argv = ["evaluate", "--data", str(d / "six.txt"), "-o", fx["out"], "--method", "saliency", "--batch-size", "2"]
    code, _, err = run_cli([*argv[:4], str(d / "whole"), *argv[5:]], capsys)
    assert code == 0, err
    whole = json.loads((d / "whole" / "evaluation.json").read_text())
    real, calls = ev_mod.perturbed_f, []

    def killed_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise SystemError("killed")  # nothing of the run's own Ctrl-C handling runs after this
        return real(*a, **k)

    monkeypatch.setattr(ev_mod, "perturbed_f", killed_third)
    monkeypatch.setattr(ckpt_mod, "CHECKPOINT_EVERY", 0.0)  # a save after every batch
    with pytest.raises(SystemError):
        run_cli(argv, capsys)
    part = json.loads((Path(fx["out"]) / "evaluation.json").read_text())
    assert part["interrupted"] == {"examples": 4, "of": 6} and len(part["examples"]) == 4
    assert part["examples"] == whole["examples"][:4]
    monkeypatch.setattr(ev_mod, "perturbed_f", real)
    code, _, err = run_cli(argv, capsys)
    assert code == 0 and "(4 examples done)" in err, err
    done = json.loads((Path(fx["out"]) / "evaluation.json").read_text())
    assert "interrupted" not in done and done["examples"] == whole["examples"]
    assert done["metrics"] == whole["metrics"]


def test_ctrl_c_says_what_was_kept(fx, capsys, monkeypatch):
    """#32 D: every command but corpus ended with a bare exit 130."""
    import mixlens.lens

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(mixlens.lens, "load", interrupt)
    code, _, err = run_cli(["explain", "hi there"], capsys)
    assert code == 130 and err.strip() == (
        "mixlens: interrupted; nothing was written (results are written only when the command finishes)"
    )


def test_relations_save_pairs_only_on_success(fx, capsys):
    """#32 D: `relations --save-pairs` wrote its file even when the command then failed."""
    pairs = Path(fx["dir"]) / "pairs.jsonl"
    argv = ["relations", "--from-conllu", fx["ud"], "-o", fx["out"], "--save-pairs", str(pairs)]
    check_one_line([*argv, "--model", "/definitely/not/here"], fx, capsys, "does not exist")
    assert not pairs.exists()
    code, _, err = run_cli(argv, capsys)
    assert code == 0 and pairs.exists() and str(pairs) in err, err


def test_data_that_is_a_directory_says_so(fx, capsys):
    """#32 D: `--data <dir>` said the file "does not exist"."""
    check_one_line(["evaluate", "--data", "{adir}", "-o", "{out}"], fx, capsys, "is a directory; give a file")


def test_evaluate_on_a_full_disk_leaves_no_folder(fx, capsys, monkeypatch):
    """#32 D: a full filesystem left an empty output folder."""
    import errno

    import mixlens.result

    def full(*a, **k):
        raise mixlens.errors.MixlensError(f"cannot write 'x': {os.strerror(errno.ENOSPC)}")

    import os

    import mixlens.errors

    monkeypatch.setattr(mixlens.result, "atomic_write", full)
    code, _, err = run_cli(["evaluate", "--data", fx["good"], "-o", fx["out"], "--method", "saliency"], capsys)
    assert code == 2 and "No space left" in err and not Path(fx["out"]).exists(), err


def test_no_tqdm_bars_into_a_pipe():
    """#32 D: transformers' GGUF loader printed a tqdm bar into piped stderr (errors became 10+ lines)."""
    import subprocess
    import sys

    code = (
        "from mixlens.commands.options import quiet_libraries; quiet_libraries(); "
        "from tqdm.auto import tqdm; list(tqdm(range(3), desc='Converting'))"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TQDM_DISABLE"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert "Converting" not in res.stderr, res.stderr


# ---- #33 item 6: --dtype / --device on every command that loads a model; a context past the position limit ----

MODEL_COMMANDS = [c for c in BASE if c not in ("methods", "families")]


def test_every_model_command_takes_dtype_and_device():
    opts = command_options()
    assert [c for c in MODEL_COMMANDS if not {"--dtype", "--device"} <= opts[c]] == []


def test_every_model_command_but_corpus_takes_family():
    """`--family` forces a layout (corpus workers load by model type: an unknown type is still matched by probe)."""
    opts = command_options()
    assert [c for c in MODEL_COMMANDS if c != "corpus" and "--model" in opts[c] and "--family" not in opts[c]] == []


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_cuda_without_cuda_is_one_line(command, fx, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_one_line([*BASE[command], "--device", "cuda"], fx, capsys, "CUDA is not available on this machine")


@pytest.mark.parametrize("command", ["analyze", "corpus", "explain", "heads"])
def test_bad_dtype_and_device_are_one_line(command, fx, capsys, monkeypatch):
    import torch

    check_one_line([*BASE[command], "--dtype", "float64"], fx, capsys, "unknown dtype 'float64'; valid: float32")
    check_one_line([*BASE[command], "--device", "tpu"], fx, capsys, "unknown device 'tpu'; valid: cpu, cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_one_line([*BASE[command], "--device", "cuda:1"], fx, capsys, "this machine has 1 CUDA device(s)")


def test_a_dtype_the_device_cannot_run_is_one_line(fx, capsys, monkeypatch):
    import torch

    real = torch.nn.functional.layer_norm

    def no_half(x, *a, **k):
        if x.dtype == torch.float16:
            raise RuntimeError("\"LayerNormKernelImpl\" not implemented for 'Half'")
        return real(x, *a, **k)

    monkeypatch.setattr(torch.nn.functional, "layer_norm", no_half)
    check_one_line(
        ["analyze", "hi there", "--dtype", "float16"], fx, capsys, 'dtype float16 cannot run on cpu: "LayerNorm'
    )


def test_a_context_past_the_position_limit_names_both_numbers(fx, capsys):
    long_text = "word " * 600
    for extra in ([], ["--max-length", "9999"]):
        check_one_line(
            ["analyze", long_text, "--no-truncate", *extra],
            fx,
            capsys,
            "input 1 has 602 tokens, more than the model's position limit of 512 tokens",
        )
    check_one_line(
        ["analyze", long_text, "--no-truncate", "--max-length", "100"],
        fx,
        capsys,
        "input 1 has 602 tokens, more than the limit of 100 (allow truncation or raise --max-length, up to the "
        "model's 512)",
    )


WRITING = [name for name, argv in BASE.items() if "-o" in argv]


@pytest.mark.parametrize("command", WRITING)
def test_every_unwritable_out_is_found_before_the_model_loads(command, fx, capsys, monkeypatch):
    """#45 item 22: an -o the user may not write into is refused before the work (prune, heads and relations
    found it after 52 s, 33 s and 14 s)."""
    import mixlens.lens

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mixlens.lens, "load", no_load)
    monkeypatch.setattr(mixlens.lens.Lens, "__init__", no_load)
    real = os.access
    monkeypatch.setattr("os.access", lambda p, mode, *a, **k: not mode & os.W_OK and real(p, mode, *a, **k))
    check_one_line(BASE[command], fx, capsys, "no permission to write in")


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", "hi", "-o", "fifo.json"],
        ["analyze", "hi", "--format", "html", "-o", "fifo.html"],
        ["report", "hi", "-o", "fifo.html"],
        ["plot", "hi", "-o", "fifo.png"],
        ["explain", "hi", "-o", "fifo.html"],
        ["explain", "hi", "--format", "json", "-o", "fifo.json"],
        ["compare-local-global", "{good}", "-o", "fifo.json"],
        ["heads", "-d", "{good}", "-o", "fifo"],  # a directory is wanted
        ["evaluate", "--data", "{good}", "-o", "fifo"],
    ],
)
def test_out_onto_a_special_file_is_refused(argv, fx, capsys, monkeypatch):
    """#45 item 15: -o onto a device node, FIFO or socket is refused before the work (it was replaced by a regular
    file: as root, `-o /dev/null` would have replaced /dev/null)."""
    import mixlens.lens

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mixlens.lens, "load", no_load)
    monkeypatch.setattr(mixlens.lens.Lens, "__init__", no_load)
    fifo = Path(fx["dir"]) / argv[-1]
    os.mkfifo(fifo)
    message = "is not a regular file" if "." in argv[-1] else "exists and is not a directory"
    check_one_line([*argv[:-1], str(fifo)], fx, capsys, message)
    assert fifo.exists() and not fifo.is_file()


def test_atomic_write_refuses_a_special_file(tmp_path):
    """The one place every file goes through refuses a non-regular target too (a command that forgot to check)."""
    from mixlens.result import atomic_write

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(MixlensError, match="is not a regular file"):
        atomic_write(fifo, b"x")
    assert not fifo.is_file() and fifo.exists()
