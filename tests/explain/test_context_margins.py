"""scripts/context_margins.py: the gold passage's share and margin, by hand on made-up passage scores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "context_margins.py"


def test_share_and_margin(tmp_path):
    examples = [
        # two answer tokens over 4 passages, gold 1: summed [1, 6, -2, 1] → share 6/10, margin (6 − 1)/10
        {"correct": True, "gold": 1, "passage_scores": {"m": [[1, 2, -1, 0], [0, 4, -1, 1]]},
         "leave_one_out": [0, 3, 0, 1]},
        # gold 0 not first: summed [2, 4, 0, -2] → share 2/8, margin (2 − 4)/8
        {"correct": True, "gold": 0, "passage_scores": {"m": [[2, 4, 0, -2]]}, "leave_one_out": [1, 0, 0, 0]},
        {"correct": False, "gold": 0, "passage_scores": {}, "leave_one_out": None},  # not scored
    ]  # fmt: skip
    run = tmp_path / "run-a"
    run.mkdir()
    (run / "evaluation.json").write_text(json.dumps({"examples": examples}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(run / "evaluation.json")], capture_output=True, text=True,
                         check=True).stdout.splitlines()  # fmt: skip
    rows = {r.split("|")[2].strip(): [c.strip() for c in r.split("|")[3:-1]] for r in out[2:]}
    share, margin = (0.6 + 0.25) / 2, (0.5 - 0.25) / 2
    assert (
        rows["m"][0] == "2" and rows["m"][1].startswith(f"{share:.2f} [") and rows["m"][2].startswith(f"{margin:.2f} [")
    )
    assert rows["m"][3] == "-0.25"
    # leave-one-out: [0, 3, 0, 1] → 3/4 and (3 − 1)/4; [1, 0, 0, 0] → 1 and 1
    assert rows["leave_one_out"][1].startswith(f"{(0.75 + 1) / 2:.2f} [") and rows["leave_one_out"][3] == "0.50"
