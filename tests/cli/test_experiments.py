"""Every experiments script the documentation names runs (issue 45, item 5: `python experiments/real_models.py`, the
command of docs/findings/models.md, crashed on a keyword renamed in `Lens.trace`). The scripts named in README.md and
docs/**/*.md are exactly those below; each documented flag is one the script takes; each script runs on a tiny input
(the SST-2 / STS-B files of ../shared/data, skipped when absent; real_models.py on a small random model saved as a
checkpoint folder)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import data_file, random_model

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NAMED = re.compile(r"experiments/([\w.-]+\.(?:py|sh))([^`\n]*)")
# script → its tiny run (argv after the script; {sst2}, {stsb}, {out}, {models} filled in), or why it is not run here
TINY: dict[str, list[str] | str] = {
    "real_models.py": ["--n", "2", "--data", "{sst2}", "tiny-llama"],
    "kobayashi2021.py": ["--data", "{sst2}", "--limit", "3"],
    "brunner_pascual.py": ["--data", "{sst2}", "--limit", "2", "--probes", "2", "--batch-size", "2"],
    "mixing_disabling.py": ["--data", "{stsb}", "--limit", "2", "--out", "{out}"],
    "finetune_sst2.py": "run by tests/bertology/test_finetune_sst2.py",
    "bertology_full_data.sh": "a 20-minute run of mixlens commands and mixing_disabling.py, each tested on its own",
}


def documented() -> dict[str, set[str]]:
    """Each script the docs name → the flags given to it there."""
    out: dict[str, set[str]] = {}
    for path in DOCS:
        for m in NAMED.finditer(path.read_text(encoding="utf-8")):
            out.setdefault(m[1], set()).update(re.findall(r"(?<![\w-])--[a-z][\w-]*", m[2].split("#")[0]))
    return out


def test_every_documented_script_exists_and_has_a_tiny_run():
    named = documented()
    assert named and set(named) == set(TINY), f"documented: {sorted(named)}; tested here: {sorted(TINY)}"
    for script in named:
        assert (ROOT / "experiments" / script).is_file(), script


@pytest.mark.parametrize("script", sorted(s for s in TINY if s.endswith(".py")))
def test_documented_flags_are_accepted(script):
    """Each flag the docs give a script is one of its argparse options (read from its source: no torch import)."""
    source = (ROOT / "experiments" / script).read_text(encoding="utf-8")
    takes = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source))
    assert takes and documented().get(script, set()) <= takes, f"{script} takes {sorted(takes)}"


@pytest.mark.parametrize("script", sorted(s for s, run in TINY.items() if isinstance(run, list)))
def test_script_runs_on_a_tiny_input(script, tmp_path, tokenizer):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    fill = {"{out}": str(tmp_path / "out"), "{models}": str(tmp_path / "models")}
    argv = TINY[script]
    assert isinstance(argv, list)
    if "{sst2}" in argv:
        fill["{sst2}"] = str(data_file("sst2", "dev.tsv"))
    if "{stsb}" in argv:
        fill["{stsb}"] = str(data_file("stsb", "dev.tsv"))
    if script == "real_models.py":  # the real checkpoints may be absent: a small random Llama in their place
        folder = tmp_path / "models" / "tiny-llama"
        random_model("llama", tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        env["MIXLENS_MODELS"] = str(tmp_path / "models")
    run = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), *(fill.get(a, a) for a in argv)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    if script == "real_models.py":
        assert "## tiny-llama" in run.stdout and "position 0: α" in run.stdout


def test_every_documented_data_path_says_where_it_comes_from():
    """Issue 45 item 7: `data/sst2/dev.tsv` does not exist in a clone; the Data list of docs/guides/your-model.md (which
    README points to) names each data folder the docs use, with its source."""
    guide = (ROOT / "docs" / "guides" / "your-model.md").read_text(encoding="utf-8")
    assert "docs/guides/your-model.md#data" in (ROOT / "README.md").read_text(encoding="utf-8")
    data_list = guide[guide.index("- **Data**") :].split("\n\n")[0]
    used = set()
    for path in DOCS:
        used |= set(re.findall(r"(?<![\w/.])(?:\.\./shared/)?data/([\w.-]+)/", path.read_text(encoding="utf-8")))
    assert used >= {"sst2", "stsb", "ud_ewt"}
    entries = data_list.split("\n  - ")[1:]  # one entry per data file or folder
    for folder in used:
        entry = next((e for e in entries if f"data/{folder}/" in e), None)
        assert entry is not None, f"the Data list does not say where data/{folder}/ comes from"
        assert "github.com" in entry or "GLUE" in entry, entry
