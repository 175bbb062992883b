"""A traced pass whose attention matrices cannot fit the memory available is refused before it starts, in one line
(exit code 2 on the command line), instead of an allocation error or the kernel's out-of-memory kill."""

from __future__ import annotations

import pytest
import torch

from mixlens import memory
from mixlens.errors import MixlensError
from tests.conftest import random_lens, run_cli


def test_the_estimate_counts_every_kept_layer():
    one = memory.attention_bytes(1, 1000, 30, 9, 1)
    assert one == 4 * 9 * 1000 * 1000 * (1 + memory.ATTENTION_COPIES)
    assert memory.attention_bytes(1, 1000, 30, 9, 30) > 7 * one
    assert memory.available_bytes() is None or memory.available_bytes() > 0


def test_a_trace_too_large_for_the_machine_is_refused_before_it_runs(tokenizer, monkeypatch):
    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM")
    enc = lens.encode(["The keys to the cabinet are on the table."])
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1000)
    calls: list[int] = []
    lens.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    with pytest.raises(MixlensError, match=r"needs about .* GB but .* GB are available") as e:
        with torch.no_grad():
            lens.trace(enc)
    assert "\n" not in str(e.value) and calls == []  # refused before the model ran
    with torch.no_grad():
        lens.trace(enc, qk_rows=True)  # the row mode keeps no [n, n]: it runs
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": None)  # unknown: no check
    with torch.no_grad():
        lens.trace(enc)


def test_the_command_line_says_it_in_one_line_with_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1000)
    code, _, err = run_cli(["analyze", "A short input.", "--method", "attention"], capsys)
    assert code == 2 and "are available" in err and len(err.strip().splitlines()) == 1
