"""`mixlens families`: the adapter table and the registry in one listing, read from a shipped file (no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mixlens import catalog
from mixlens.adapters import FAMILIES
from mixlens.methods import REGISTRY


def test_shipped_family_catalog_is_the_table_and_the_registry():
    """data/families.json must equal what the table and the registry declare now (`python -m mixlens.catalog`)."""
    assert catalog.load_families() == catalog.build_families(), (
        "stale src/mixlens/data/families.json: run python -m mixlens.catalog"
    )


def test_every_family_lists_each_method_once_with_the_registrys_reason():
    for fam, entry in zip(FAMILIES, catalog.build_families(), strict=True):
        assert entry["name"] == fam.name and entry["model_types"] == list(fam.model_types)
        assert set(entry["runs"]) | set(entry["refuses"]) == set(REGISTRY)
        assert not set(entry["runs"]) & set(entry["refuses"])
        for name, why in entry["refuses"].items():
            assert REGISTRY[name].supports(fam) == why


def test_traits_come_from_the_declaration():
    by_name = {e["name"]: e for e in catalog.build_families()}
    assert "mixture-of-experts FFN" in by_name["moe"]["traits"]
    assert "no norm after the attention residual sum" in by_name["olmo2"]["traits"]
    assert "post-LN blocks" in by_name["bert"]["traits"] and "encoder" in by_name["bert"]["traits"]
    assert "alti" in by_name["olmo2"]["refuses"] and "attnlrp" in by_name["moe"]["refuses"]
    assert "norm_resln" in by_name["olmo2"]["runs"]  # no norm after the sum: the ResLN map is the identity


@pytest.mark.slow  # starts a fresh process
def test_families_command_is_fast_narrow_and_complete():
    code = (
        "import sys; from mixlens.cli import main\n"
        "for args in (['families'], ['families', '--json']):\n"
        "    try:\n        main(args)\n    except SystemExit:\n        pass\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text, _, js = out.stdout.partition("\n[\n")
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert {line.split()[0] for line in lines if line and not line.startswith(" ")} == {f.name for f in FAMILIES}
    assert [e["name"] for e in json.loads("[\n" + js)] == [f.name for f in FAMILIES]
