"""#45 item 13: evaluate bounds its memory on long decoder inputs. Each batch's passes (its trace, the methods'
results, each gradient pass, the perturbed forwards) are estimated before any of them runs, and a batch that cannot
fit is refused in one line naming its longest input; a causal LM's row-mode methods read a streamed trace that keeps
no layer's tensors, with the same scores as a kept trace."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from mixlens import memory
from mixlens.errors import MixlensError
from mixlens.explain import evaluate as E
from mixlens.explain import fits
from mixlens.explain.evaluation import Contrast
from tests.conftest import random_lens, run_cli

SHORT = "The keys to the cabinet"
LONG = "The keys that the man who lives next to the old mill by the river keeps in a box to the cabinet"


@pytest.fixture(scope="module")
def causal(tokenizer):
    return random_lens("llama", tokenizer, head="AutoModelForCausalLM")


def _layer_calls(lens) -> list[int]:
    """Counts every pass through the model (traced, gradient, perturbed): each runs its first layer."""
    calls: list[int] = []
    lens.adapter.layers[0].module.register_forward_pre_hook(lambda m, a: calls.append(1))
    return calls


@pytest.mark.parametrize("methods", [["attention"], ["saliency"], ["logit_attn", "integrated_gradients"]])
def test_a_batch_that_cannot_fit_is_refused_before_any_of_its_passes(tokenizer, methods, monkeypatch):
    """The first batch (a short input) fits and runs; the second (a long one) is refused before its first pass:
    no model pass runs after the first batch's, and the line names the input, its length, the estimate and the
    memory available."""
    lens = random_lens("llama", tokenizer, head="AutoModelForCausalLM")
    n_long = len(lens.encode([LONG]).tokens[0])
    n_short = len(lens.encode([SHORT]).tokens[0])
    streamed = methods == ["attention"]
    one_row = [m for m in methods if m == "attention"]
    need = {
        n: sum(fits.batch_bytes(lens, methods, 1, n, streamed=streamed, one_row=one_row).values())
        for n in (n_short, n_long)
    }
    assert need[n_short] < need[n_long]
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": need[n_long] - 1)
    calls = _layer_calls(lens)
    after_first: list[int] = []
    with pytest.raises(MixlensError) as e:
        E.evaluate(
            lens,
            [SHORT, LONG],
            methods,
            batch_size=1,
            checkpoint=lambda _: after_first.append(len(calls)),
            checkpoint_every=0,
        )
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"input 2 ({n_long} tokens) needs about")
    assert "B are available" in msg
    assert after_first and after_first[0] > 0 and len(calls) == after_first[0]  # nothing ran for input 2


def test_a_too_long_first_input_runs_no_pass_at_all(causal, monkeypatch):
    """#45 item 13: the gradient pass was refused only after the traced forward had run (2.5 minutes at 8,105
    tokens on SmolLM2); now nothing runs."""
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1000)
    calls = _layer_calls(causal)
    cs = [Contrast("toy", 5, 7, "a", "b", "keys", (1,))]
    with pytest.raises(MixlensError, match=r"^input 1 \(toy, \d+ tokens\) needs about .* but 0\.0 MB are avail"):
        E.evaluate(causal, [LONG], ["saliency"], contrasts=cs, task="blimp")
    assert calls == []
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": None)  # unknown: no check
    E.evaluate(causal, [LONG], ["saliency"], contrasts=cs, task="blimp", removal="none")


def test_the_command_line_refuses_in_one_line_with_exit_2(causal, tmp_path, monkeypatch, capsys):
    model_dir = tmp_path / "model"
    causal.model.save_pretrained(model_dir)
    causal.tokenizer.save_pretrained(model_dir)
    data = tmp_path / "texts.txt"
    data.write_text(f"{SHORT}\n{LONG}\n")
    capsys.readouterr()  # the saving's progress
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1000)
    code, _, err = run_cli(
        ["evaluate", "--model", str(model_dir), "--data", str(data), "--method", "attention"]
        + ["-o", str(tmp_path / "o")],
        capsys,
    )
    assert code == 2 and "input 2 (" in err and "are available" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("methods", [["attention", "attention_rollout", "saliency"], ["saliency", "grad_x_input"]])
def test_the_streamed_trace_gives_the_kept_traces_scores(tokenizer, family, methods, monkeypatch):
    """Row-mode methods on a causal LM read a streamed trace (no layer's tensors kept, the logits of the last
    tokens only) beside an inputs-only one for the gradient methods; without a method reading a trace, the targets
    come from one fused pass with the last tokens' logits: every score, f and removal curve equals the kept trace's
    (a plain pass's), on padded batches with and without contrasts."""
    lens = random_lens(family, tokenizer, head="AutoModelForCausalLM")
    texts = [SHORT, LONG, "A dog", "Cats sleep on the mat all day"]
    cs = [Contrast("toy", 5 + k, 9 + k, "a", "b", "x", (1,)) for k in range(len(texts))]
    for contrasts in (None, cs):
        runs = {}
        for stream in (True, False):
            monkeypatch.setattr(E, "STREAM", stream)
            kw = {"contrasts": contrasts, "task": "blimp"} if contrasts else {}
            runs[stream] = E.evaluate(lens, texts, methods, batch_size=3, **kw)
        for a, b in zip(runs[True].examples, runs[False].examples, strict=True):
            assert a.ids == b.ids and {**a.target, "score": 0} == {**b.target, "score": 0}
            assert a.target["score"] == pytest.approx(b.target["score"], rel=1e-5)
            assert a.f == pytest.approx(b.f, rel=1e-5, abs=1e-6)
            for m in methods:
                torch.testing.assert_close(torch.tensor(a.scores[m]), torch.tensor(b.scores[m]), rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(torch.tensor(a.removed[m]), torch.tensor(b.removed[m]))
            torch.testing.assert_close(torch.tensor(a.reference), torch.tensor(b.reference))


def test_the_faithfulness_file_streams(causal, tmp_path, monkeypatch, capsys):
    """#45 item 13: the faithfulness task's file was read whole into a list before the first example. Its records
    are now read as the batches ask for them: when the first batch of 2 is done, the run's own read of a 5,000-line
    file has given a handful of records (after one counting pass that keeps none); the run's identity (the data's
    hash) is kept, and a changed file is refused on resume."""
    from mixlens.commands import explain as cmd
    from mixlens.corpus import readers
    from mixlens.explain import checkpoint

    model_dir = tmp_path / "model"
    causal.model.save_pretrained(model_dir)
    causal.tokenizer.save_pretrained(model_dir)
    data = tmp_path / "big.txt"
    data.write_text("".join(f"Line {k} of the file.\n" for k in range(5000)))
    capsys.readouterr()
    reads: list[int] = []  # records given by each read of the file
    real_read, real_write = readers.iter_examples, cmd._write

    def counted(*a, **k):
        reads.append(0)
        for ex in real_read(*a, **k):
            reads[-1] += 1
            yield ex

    at_first_batch: list[list[int]] = []

    def write(*a, **k):
        if not at_first_batch:  # the first checkpoint, after the first batch: stop there (as Ctrl-C would)
            at_first_batch.append(list(reads))
            raise KeyboardInterrupt
        return real_write(*a, **k)

    monkeypatch.setattr(readers, "iter_examples", counted)
    monkeypatch.setattr(cmd, "_write", write)
    monkeypatch.setattr(checkpoint, "CHECKPOINT_EVERY", 0)
    out = tmp_path / "o"
    args = ["evaluate", "--model", str(model_dir), "--data", str(data), "--method", "attention"]
    args += ["--removal", "none", "--batch-size", "2", "-o", str(out)]
    code, _, err = run_cli(args, capsys)
    assert code == 130, err
    assert at_first_batch[0][0] == 5000 and len(at_first_batch[0]) == 2  # the counting pass, then the run's read
    assert at_first_batch[0][1] <= 8  # the first batch ran after a handful of records, not 5,000
    saved = checkpoint.read_saved(out / checkpoint.FILE)
    assert saved is not None and len(saved["examples"]) == 2 and saved["run"]["data"] == checkpoint.data_stamp(data)
    data.write_text("".join(f"Line {k} of another file.\n" for k in range(5000)))  # changed data: refused
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "data" in err and len(err.strip().splitlines()) == 1


def test_a_causal_lms_perturbed_forwards_run_fused_with_the_eager_values(causal, monkeypatch):
    """The removal curves' forwards of a causal LM run in torch's fused attention (no [B, H, n, n] per layer: at
    2,015 tokens on SmolLM2 two inputs' eager attention took about 0.9 GB); f equals the eager forwards' to 1e-5
    and the model is eager again afterwards."""
    from mixlens.explain import scoring

    seen: list[str] = []
    real = causal.model.forward

    def spy(*a, **k):
        seen.append(causal.model.config._attn_implementation)
        return real(*a, **k)

    monkeypatch.setattr(causal.model, "forward", spy)
    seqs = [tuple(causal.encode([t]).inputs["input_ids"][0].tolist()) for t in (SHORT, LONG)]
    index, foil = torch.tensor([5]), torch.tensor([9])
    got = scoring.forward_f(causal, "causal", "", seqs, [0, 0], index, torch.zeros(1, 1), foil)
    assert seen and set(seen) == {"sdpa"} and causal.model.config._attn_implementation == "eager"
    monkeypatch.setattr(scoring, "fused", lambda model, kind: contextlib.nullcontext())
    want = scoring.forward_f(causal, "causal", "", seqs, [0, 0], index, torch.zeros(1, 1), foil)
    assert seen[-1] == "eager"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
