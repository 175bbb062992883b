"""The suite never writes into the directory it is started from (issue 45, item 9): `tests/cwd_guard.py` runs each
test in its own folder and fails a test that leaves a file in the starting directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import os
from pathlib import Path

def test_default_output_lands_in_its_own_folder():
    Path("mixlens-analysis.json").write_text("{}")  # a command's default output, relative to the working directory

def test_writing_into_the_users_folder_fails():
    (Path(os.environ["USER_DIR"]) / "mixlens-report.html").write_text("x")
"""


def test_tests_leave_the_working_directory_alone(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "mixlens-analysis.json").write_text('{"mine": 1}')
    probe = tmp_path / "probe" / "test_probe.py"
    probe.parent.mkdir()
    probe.write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "USER_DIR": str(user)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.cwd_guard", "-p", "no:cacheprovider", str(probe)],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (user / "mixlens-analysis.json").read_text() == '{"mine": 1}'  # the user's file is not overwritten
    assert "2 passed, 1 error" in run.stdout, run.stdout + run.stderr
    assert "left mixlens-report.html in the working directory" in run.stdout
