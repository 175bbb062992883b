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
    with pytest.raises(MixlensError, match=r"needs about .* GB but .* GB are available") as e, torch.no_grad():
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


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_attention_on_a_decoder_traces_in_row_mode(family, tokenizer):
    """`attention` reads α by rows: on a causal LM its trace keeps q and K, no [B, H, n, n] per layer (what explain
    and evaluate run for a long input); its target rows, and all rows when asked, equal the eager trace's."""
    from mixlens.pipeline import run_methods
    from tests.conftest import SENTENCES

    lens = random_lens(family, tokenizer, head="AutoModelForCausalLM")
    enc = lens.encode(SENTENCES)
    with torch.no_grad():
        rows = lens.trace_for(enc, ["attention"])
        full = lens.trace(enc)
    assert all(lt.qk is not None and lt.alpha.numel() == 0 for lt in rows.layers)
    for heads in (False, True):
        for targets in ("last", None):
            got = run_methods(rows, ["attention"], heads=heads, targets=targets).values["attention"]
            want = run_methods(full, ["attention"], heads=heads, targets=targets).values["attention"]
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_an_allocation_failure_is_one_line_with_exit_2(monkeypatch, capsys):
    """An allocation that fails past the estimate (a method's own n × n results) ends in one line, exit code 2."""
    from mixlens import trace

    def fail(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 76204032000 bytes.")

    monkeypatch.setattr(trace, "check_fits", fail)
    code, _, err = run_cli(["analyze", "A short input.", "--method", "attention"], capsys)
    assert code == 2 and "out of memory" in err and "76204032000 bytes" in err
    assert len(err.strip().splitlines()) == 1
    assert memory.out_of_memory(RuntimeError("shape mismatch")) is None  # other errors stay errors
