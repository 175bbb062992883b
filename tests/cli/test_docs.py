"""Every ```python and ```bash block of README.md and docs/**/*.md runs, so the documentation cannot drift.

Python blocks of one file run in order in one shared namespace; bash blocks run each `mixlens ...` command
(continuation lines joined, comments dropped) through the in-process CLI and expect exit code 0. Each file runs
in a fresh directory holding a tiny `data/` (SST-2 and STS-B shaped), so the documented relative data paths
(`data/sst2/dev.tsv`, ...) resolve to small inputs; model placeholders name the bundled model, with random
classifier heads allowed (those examples test plumbing; the refusal of random heads is tested in
test_hardening.py), and
`artifacts/sst2-minilm` (the fine-tuned classifier of experiments/finetune_sst2.py, which CI does not train) is a
saved, untrained two-label classifier built from the bundled model. A block preceded by the line
`<!-- docs-test: skip: REASON -->` is not run (the reason says why: a server, an install, data we do not have).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import mixlens
from mixlens.cli import main
from mixlens.lens import default_model_path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(
    r"^(?:<!-- docs-test: skip: (?P<skip>.+?) -->\n)?```(?P<lang>python|bash)\n(?P<code>.*?)^```", re.M | re.S
)
# placeholders in the docs for a user's own model → the bundled model
PLACEHOLDERS = {'"path/to/sst2-model"': "MODEL", '"path/or/hub-id"': "MODEL"}
SST2 = [
    "sentence\tlabel",
    "a charming and often affecting journey .\t1",
    "unflinchingly bleak and desperate\t0",
    "the acting , costumes , music , cinematography and sound are all astounding\t1",
    "it 's slow -- very slow\t0",
]
STSB = [
    "sentence1\tsentence2\tscore",
    "A man is playing a guitar.\tA man plays the guitar.\t4.8",
    "A woman is slicing an onion.\tSomeone is cutting a tomato.\t1.2",
]


def rel(path: Path) -> str:
    """The doc's path relative to the repository (README.md, docs/guides/corpus.md, ...)."""
    return path.relative_to(ROOT).as_posix()


def blocks(path: Path) -> list[tuple[int, str, str, str | None]]:
    """(line, language, code, skip reason or None) of each fenced python/bash block."""
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 1, m["lang"], m["code"], m["skip"]) for m in BLOCK.finditer(text)]


def commands(code: str) -> list[list[str]]:
    """The argv (after `mixlens`) of each command of a bash block; every command must be a `mixlens` call."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        assert argv[0] == "mixlens", f"a bash block runs something else than mixlens: {line!r} (add a skip marker)"
        out.append(argv[1:])
    return out


def test_every_doc_has_blocks_found():
    found = {rel(p): blocks(p) for p in DOCS}
    assert found["README.md"] and found["docs/guides/corpus.md"] and found["docs/guides/bertology.md"]
    for doc, bs in found.items():
        for line, _, _, skip in bs:
            assert skip is None or skip.strip(), f"{doc}:{line}: a skip marker must say why"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stand-in for artifacts/sst2-minilm: the bundled model saved with a (untrained) SST-2 label head."""
    import transformers

    out = tmp_path_factory.mktemp("sst2-minilm")
    net = transformers.AutoModelForSequenceClassification.from_pretrained(
        default_model_path(),
        num_labels=2,
        id2label={0: "negative", 1: "positive"},
        label2id={"negative": 0, "positive": 1},
    )
    net.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def given():
    """What the docs take as the reader's own objects: texts, and a model built by hand (model + tokenizer)."""
    lens = mixlens.load()
    return {"texts": ["A first text.", "A second, longer text."], "hf_model": lens.model, "tokenizer": lens.tokenizer}


@pytest.mark.parametrize("path", DOCS, ids=[rel(p) for p in DOCS])
def test_doc_blocks_run(path, tmp_path, monkeypatch, given, checkpoint, capsys):
    work = tmp_path / "repo"
    data = work / "data"
    for name, rows in (("sst2", SST2), ("stsb", STSB)):
        (data / name).mkdir(parents=True)
        (data / name / "dev.tsv").write_text("\n".join(rows) + "\n")
    (work / "artifacts").mkdir(parents=True)
    (work / "artifacts" / "sst2-minilm").symlink_to(checkpoint, target_is_directory=True)
    monkeypatch.chdir(work)
    real_load = mixlens.lens.load

    def load(*args: object, **kwargs: object) -> mixlens.Lens:
        return real_load(*args, **{**kwargs, "allow_random_head": True})

    monkeypatch.setattr(mixlens.lens, "load", load)
    monkeypatch.setattr(mixlens, "load", load)
    ns: dict = {"__name__": f"docs_{path.stem}", **given}
    ran = 0
    for line, lang, code, skip in blocks(path):
        if skip is not None:
            continue
        where = f"{rel(path)}:{line}"
        if lang == "python":
            for old, new in PLACEHOLDERS.items():
                code = code.replace(old, repr(str(default_model_path())) if new == "MODEL" else new)
            exec(compile(code, where, "exec"), ns)  # noqa: S102 (the documentation's own code)
        else:
            for argv in commands(code):
                with pytest.raises(SystemExit) as e:
                    main(argv)
                assert e.value.code in (0, None), (
                    f"{where}: mixlens {' '.join(argv)} → exit {e.value.code}: {capsys.readouterr().err[-500:]}"
                )
        ran += 1
    if not ran:
        pytest.skip(f"{rel(path)} has no runnable code block")


def test_submodules_load_on_attribute_access():
    """`import mixlens` then a documented dotted path works without importing the submodule first."""
    import subprocess
    import sys

    code = "import mixlens; f = mixlens.stats.mixing.expansion_rate; m = mixlens.bertology.sweep; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mixlens.stats.nope  # noqa: B018


IMAGE = re.compile(r"!\[[^\]]*\]\((?P<path>[^)\s]+\.(?:png|svg))\)")


@pytest.mark.parametrize("path", DOCS, ids=[rel(p) for p in DOCS])
def test_doc_images_exist(path):
    """Every figure a doc shows (`![...](path.png)`, relative to the doc) is in the repository."""
    for m in IMAGE.finditer(path.read_text()):
        if "://" in m["path"]:
            continue
        assert (path.parent / m["path"]).is_file(), f"{rel(path)}: figure {m['path']} is missing"
