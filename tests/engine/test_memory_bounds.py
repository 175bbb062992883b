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
        for spec in ("last", None):
            got = run_methods(rows, ["attention"], heads=heads, rows=spec).values["attention"]
            want = run_methods(full, ["attention"], heads=heads, rows=spec).values["attention"]
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


def test_the_estimate_counts_each_methods_own_results():
    """#45 item 13: the estimate left out the methods' own results ([L, n, n] maps, [L, H, n, n] with heads)."""
    kw = {"batch": 2, "n": 1000, "layers": 30, "heads": 9}
    alpha_rows = 4 * 2 * 9 * 1000 * 1000  # one layer's [B, H, n, n] read while a map is built
    assert memory.result_bytes([("layer", "target", "source")], **kw) == 4 * 2 * 30 * 1000 * 1000 + alpha_rows
    assert memory.result_bytes([("layer", "head", "target", "source")], **kw) == 4 * 2 * 30 * 9 * 10**6 + alpha_rows
    assert memory.result_bytes([("layer", "target", "source")], rows=1, **kw) == 4 * 2 * 30 * 1000 + 4 * 2 * 9 * 1000
    assert memory.result_bytes([("source",), ("class", "source")], **kw) == 2 * 4 * 2 * 1000


def test_results_too_large_are_refused_before_the_work(tokenizer, monkeypatch, capsys):
    """analyze of every row on a long input: refused before any pass, in one line, naming the row mode; the same
    methods on the last row only fit and run."""
    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM")
    text = "one two three four five six seven eight nine"
    n, layers, heads = len(lens.encode([text]).tokens[0]), lens.adapter.n_layers, lens.adapter.n_heads
    per_map = memory.result_bytes([("layer", "target", "source")], batch=1, n=n, layers=layers, heads=heads)
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": per_map)  # heads=False fits, heads=True not
    from mixlens import pipeline

    monkeypatch.setattr(pipeline, "check_fits", memory.check_fits)
    calls: list[int] = []
    lens.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    lens.analyze(text, ["attention"], rows="all")
    with pytest.raises(
        MixlensError, match=r"computing attention on 1 × \d+ tokens \(\[layer, head, n, n\] results\) needs about"
    ) as e:
        lens.analyze(text, ["attention"], heads=True, rows="all")
    assert "\n" not in str(e.value) and "--rows last" in str(e.value)
    ran = len(calls)
    with pytest.raises(MixlensError):
        lens.analyze(text, ["attention"], heads=True, rows="all")
    assert len(calls) == ran  # refused before the model ran
    lens.analyze(text, ["attention"], heads=True, rows="last")


def test_explain_and_evaluate_compute_only_the_explained_row(tokenizer, monkeypatch):
    """#45 item 13: explain and evaluate built every row of a map method ([L, n, n]: 480 MB for `attention` at 2,000
    tokens on SmolLM2) to read one; they now ask for the explained row alone, with the same scores."""
    from mixlens.explain import attributions, explain
    from mixlens.pipeline import run_methods

    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM")
    texts = ["The keys to the cabinet are", "A much longer input than the first one, on the table"]
    shapes = []

    def spy(trace, methods, **kw):
        out = run_methods(trace, methods, **kw)
        shapes.extend((m, tuple(v.shape)) for m, v in out.values.items())
        return out

    monkeypatch.setattr(attributions, "run_methods", spy)
    ex = explain(lens, texts, ["attention", "attention_rollout", "saliency"], batch_size=2)
    maps = [s for m, s in shapes if m in ("attention", "attention_rollout")]
    assert maps and all(s[2] == 1 for s in maps)  # [B, layer, 1 row, source]
    with torch.no_grad():
        enc = lens.encode(texts)
        full = run_methods(lens.trace(enc), ["attention", "attention_rollout"]).values  # every row, as before
    for m in ("attention", "attention_rollout"):
        for b, one in enumerate(ex.inputs):
            n = len(enc.tokens[b])
            torch.testing.assert_close(
                torch.as_tensor(one.scores[m][:n]), full[m][b, -1, n - 1, :n].float(), atol=1e-6, rtol=1e-5
            )


def test_a_gradient_pass_too_large_is_refused_before_it_runs(tokenizer, monkeypatch):
    """#45 item 13: a BLiMP prompt of 8,105 tokens with `--method attention --removal none` passed every check and
    was killed (evaluate's agreement reference is a gradient: its backward keeps every layer's activations, 13 GB
    on SmolLM2). The gradient pass is now estimated (`memory.backward_bytes`) and refused in one line first; explain
    estimates each batch's trace, results and gradient pass (`explain.fits`) before any pass of it runs."""
    from mixlens.explain import explain, fits

    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM")
    text = "The keys to the cabinet are"
    n, layers = len(lens.encode([text]).tokens[0]), lens.adapter.n_layers
    d = lens.model.get_input_embeddings().embedding_dim
    need = memory.backward_bytes(1, n, layers, d)
    assert need == 4 * n * d * (layers + memory.BACKWARD_FLOATS)  # each layer's input, one layer's activations
    explain(lens, text, ["saliency"])  # fits

    def whole(methods: list[str]) -> int:
        return sum(fits.batch_bytes(lens, methods, 1, n, streamed=False, reference=False, removal=False).values())

    assert whole(["saliency"]) >= need  # the trace and results besides the gradient pass
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": whole(["saliency"]) - 1)
    calls: list[int] = []
    lens.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    with pytest.raises(MixlensError, match=rf"input 1 \({n} tokens\) needs about .* the largest pass") as e:
        explain(lens, text, ["saliency"])
    assert "\n" not in str(e.value) and not calls  # refused before any pass of the model
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": whole(["saliency"]))
    explain(lens, text, ["saliency"])  # just fits: it runs
    assert calls
    # the methods' own check still holds where an estimate passes: the gradient pass alone over the memory
    monkeypatch.setattr(fits, "check_batch", lambda *a, **k: None)
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": need - 1)
    with pytest.raises(MixlensError, match=r"a gradient pass on 1 × \d+ tokens .* needs about"):
        explain(lens, text, ["saliency"])
