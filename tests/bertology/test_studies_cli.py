"""`mixlens frequency` and `mixlens identify` end to end (their options are one shared block, `TEXT_STUDY`)."""

from __future__ import annotations

import pandas as pd

from tests.conftest import data_file, run_cli


def test_cli_frequency(tmp_path, capsys):
    f = data_file("sst2", "dev.tsv")
    args = ["frequency", "-d", str(f), "--limit", "3", "--batch-size", "2", "-o", str(tmp_path)]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert "frequency_rho.csv, frequency_tokens.csv and frequency.png" in err
    for name in ("frequency_rho.csv", "frequency_tokens.csv", "frequency.png"):
        assert (tmp_path / name).is_file()


def test_figure_titles_name_a_local_model_by_its_folder(tmp_path, capsys, monkeypatch):
    """A figure is often published: its title names the model's folder, never the whole path of this machine."""
    import mixlens.bertology.frequency as freq
    from mixlens.lens import default_model_path

    titles: list[str] = []
    monkeypatch.setattr(freq, "frequency_figure", lambda rep, path, title: titles.append(title))
    model = default_model_path()
    f = data_file("sst2", "dev.tsv")
    args = ["frequency", "-d", str(f), "--limit", "2", "--model", str(model), "-o", str(tmp_path)]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert len(titles) == 1 and titles[0].startswith(f"{model.name}: ") and str(model.parent) not in titles[0]


def test_cli_identify(tmp_path, capsys):
    f = data_file("sst2", "dev.tsv")
    args = ["identify", "-d", str(f), "--limit", "6", "--probe", "nn_cos", "--probe", "linear", "-o", str(tmp_path)]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert "identify.csv and identify.png" in err and (tmp_path / "identify.png").is_file()
    table = pd.read_csv(tmp_path / "identify.csv")
    assert "nn_cos" in table.to_csv() and "linear" in table.to_csv() and "mlp" not in table.to_csv()


def test_cli_studies_empty_data(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for cmd in ("frequency", "identify"):
        code, _, err = run_cli([cmd, "-d", str(empty), "-o", str(tmp_path / cmd)], capsys)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_studies_read_the_base_model(tmp_path, capsys):
    """A checkpoint whose config names a masked-LM head it does not carry (all-mpnet-base-v2 is one): the studies
    read only hidden states and attention, so they load the base model instead of refusing a random head."""
    import json

    import mixlens

    lens = mixlens.load()
    model_dir = tmp_path / "model"
    lens.model.save_pretrained(model_dir)
    lens.tokenizer.save_pretrained(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertForMaskedLM"]}))
    f = data_file("sst2", "dev.tsv")
    for cmd in ("frequency", "identify"):
        args = [cmd, "-d", str(f), "--model", str(model_dir), "--limit", "4", "-o", str(tmp_path / cmd)]
        code, _, err = run_cli(args, capsys)
        assert code == 0, err


def test_a_missing_extra_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """wordfreq is the `studies` extra: without it the study stops before loading anything, with the pip line."""
    import sys

    import pytest

    from mixlens.bertology.frequency import zipf
    from mixlens.errors import MixlensError

    assert zipf("the") > 5  # installed: the real word list
    monkeypatch.setitem(sys.modules, "wordfreq", None)  # `import wordfreq` now raises ImportError
    with pytest.raises(
        MixlensError, match=r'^wordfreq is not installed; install it with: pip install "mixlens\[studies\]"$'
    ):
        zipf("the")
    args = ["frequency", "-d", str(data_file("sst2", "dev.tsv")), "--limit", "2", "-o", str(tmp_path)]
    code, out, err = run_cli(args, capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        'mixlens: error: wordfreq is not installed; install it with: pip install "mixlens[studies]"'
    ]
    assert not list(tmp_path.iterdir())
