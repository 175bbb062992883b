"""A pytest plugin (loaded by conftest.py): every test runs in a fresh folder of its own, so a command's default
output (./mixlens-analysis.json, ./mixlens-report.html, ...) lands there, never over the user's files; a test that
still leaves a new file or folder in the directory pytest was started from fails, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

CACHES = {".pytest_cache", "__pycache__", ".mypy_cache", ".ruff_cache", ".hypothesis", ".coverage"}


@pytest.fixture(autouse=True)
def _working_directory_untouched(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    cwd = Path.cwd()
    before = {p.name for p in cwd.iterdir()}
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    left = sorted({p.name for p in cwd.iterdir()} - before - CACHES)
    if left:
        pytest.fail(f"the test left {', '.join(left)} in the working directory {cwd}; write under tmp_path")
