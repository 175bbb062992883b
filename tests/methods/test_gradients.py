"""HTA and per-head attribution against reverse-mode Jacobians on small random models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mixlens.cli import main
from mixlens.methods import gradients as G
from tests.conftest import random_lens

TEXTS = ["A dog barked.", "Short one, a bit longer."]
TINY = {
    "bert": dict(hidden_size=32, intermediate_size=64),
    "gpt2": dict(n_embd=32),
    "llama": dict(hidden_size=32, intermediate_size=64),
    "albert": dict(hidden_size=32, intermediate_size=64),
}


def tiny(tokenizer, family: str = "bert"):
    return random_lens(family, tokenizer, **TINY[family])


def reverse_norms(tr, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """‖J‖²_F blocks from torch.autograd.functional.jacobian: [B, L, n, n] and [B, L, H, n, n]."""
    b, n, _ = tr.layers[0].x.shape
    f = G.states_fn(tr, where)
    d0 = torch.zeros(b, n, G.input_dim(tr, where))
    with torch.enable_grad():
        # [L, B, n, d, B, n, d_in] and [L, B, H, n, d_h, B, n, d_in]
        je, jo = torch.autograd.functional.jacobian(f, d0, vectorize=True)
    bi = torch.arange(b)
    je = je[:, bi, :, :, bi]  # same input only: [B, L, n, d, n, d_in]
    jo = jo[:, bi, :, :, :, bi]  # [B, L, H, n, dh, n, d_in]
    return je.pow(2).sum((3, 5)), jo.pow(2).sum((4, 6))


@pytest.mark.parametrize(
    "family,where", [("bert", "word"), ("gpt2", "word"), ("llama", "embedding"), ("albert", "embedding")]
)
def test_exact_matches_reverse_mode(tokenizer, family, where):
    lens = tiny(tokenizer, family)
    tr = lens.trace(TEXTS)
    jn = G.jacobian_norms(tr, input=where, chunk=97)  # odd chunk: exercises chunk boundaries
    sq_e, sq_o = reverse_norms(tr, where)
    m = tr.mask.float()
    sq_e = sq_e * m[:, None, :, None] * m[:, None, None, :]
    sq_o = sq_o * m[:, None, None, :, None] * m[:, None, None, None, :]
    assert sq_e.abs().max() > 0 and sq_o.abs().max() > 0
    torch.testing.assert_close(jn.hidden, sq_e, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(jn.heads, sq_o, rtol=1e-4, atol=1e-6)
    c = G.hta(tr, input=where).values
    lengths = tr.mask.sum(-1)
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(c[b, :, :n].sum(-1), torch.ones(c.shape[1], n))
        assert c[b, :, n:].abs().sum() == 0 and c[b, :, :, n:].abs().sum() == 0
    if family in ("gpt2", "llama"):  # causal: no attribution to later tokens
        assert torch.triu(c[0, :, :, :], diagonal=1).abs().max() < 1e-7


def test_hand_built_identity_model(tokenizer):
    """Zero attention values and FFN weights and identity LayerNorms: each layer output is its input, so
    ∂e^l_i/∂x_j = [i=j]·I and HTA is the identity matrix at every layer."""
    lens = tiny(tokenizer)
    with torch.no_grad():
        for lay in lens.adapter.base.encoder.layer:
            for lin in (lay.attention.self.value, lay.attention.output.dense, lay.intermediate.dense, lay.output.dense):
                lin.weight.zero_()
                lin.bias.zero_()
    tr = lens.trace(["one two three"])
    jn = G.jacobian_norms(tr, input="embedding")
    n = tr.layers[0].x.shape[1]
    # post-LN with zeroed branches: e = LN(LN(x)); LN has Jacobian γ/s (I − 11ᵀ/d − x̂x̂ᵀ/d) per token
    x = tr.layers[0].x[0]
    d = x.shape[-1]
    ln = lens.adapter.base.encoder.layer[0].attention.output.LayerNorm
    s = torch.sqrt(x.var(-1, unbiased=False) + ln.eps)
    # LN Jacobian (I − 11ᵀ/d − x̂x̂ᵀ/d)/s, a rank-(d−2) projection over s; LN2 then sees a normalised vector
    # (its s ≈ 1, same projection), so ‖J‖²_F = (d − 2)/s² (γ = 1)
    expected_first = (d - 2) / s**2
    assert torch.allclose(jn.hidden[0, 0].diagonal(), expected_first, rtol=1e-4)
    off = jn.hidden[0, :, ~torch.eye(n, dtype=torch.bool)]
    assert off.abs().max() < 1e-10
    torch.testing.assert_close(G.hta(tr, input="embedding").values[0], torch.eye(n).expand(len(tr.layers), n, n))


def test_batched_equals_unbatched(tokenizer):
    lens = tiny(tokenizer)
    both = lens.trace(TEXTS)
    hb = G.head_attribution(both).values
    for b, text in enumerate(TEXTS):
        one = G.head_attribution(lens.trace([text])).values
        n = one.shape[-1]
        torch.testing.assert_close(hb[b, ..., :n, :n], one[0], atol=1e-5, rtol=1e-4)


def test_estimate_unbiased_with_stderr(tokenizer):
    lens = tiny(tokenizer)
    tr = lens.trace(TEXTS[:1])
    exact = G.jacobian_norms(tr).hidden
    est = G.jacobian_norms(tr, mode="estimate", probes=64, seed=1)
    m = exact > 0
    z = (est.hidden - exact)[m] / est.hidden_se[m].clamp_min(1e-12)
    assert z.abs().mean() < 1.5  # errors are on the scale of the reported standard errors
    assert ((est.hidden - exact).abs() / exact)[m].median() < 0.2
    out = G.hta(tr, mode="estimate", probes=16)
    se = out.extras["stderr"]
    assert se.shape == exact.shape == out.values.shape and se.max() > 0
    assert G.hta(tr).extras == {}  # exact mode has no estimation error


def test_analyze_and_cli_errors(tokenizer, tmp_path, capsys):
    lens = tiny(tokenizer)
    res = lens.analyze(TEXTS, ["hta", "head_attribution"], options={"hta": {"mode": "estimate", "probes": 4}})
    assert res["hta"].dims == ("layer", "target", "source")
    assert res["head_attribution"].dims == ("layer", "head", "target", "source")
    assert res["hta"].extras["stderr"].shape == res["hta"].values.shape and res["hta"].extras["stderr"].max() > 0
    assert res["head_attribution"].extra_store == {}  # exact mode
    entry = res.to_json()["inputs"][0]["methods"]["hta"]
    assert entry["extras"]["stderr"]["dims"] == ["layer", "target", "source"]
    stderr = np.array(entry["extras"]["stderr"]["values"], np.float32)
    np.testing.assert_array_equal(stderr, res["hta"].extra_store["stderr"].row(0))
    for argv, msg in (
        (["--option", "hta.mode=fast"], "hta.mode must be one of exact, estimate, got 'fast'"),
        (["--option", "hta.input=pos"], "hta.input must be one of word, embedding"),
        (["--option", "hta.output=stderr"], "method 'hta' has no option 'output'"),
        (["--option", "hta.mode=estimate", "--option", "hta.probes=1"], "hta.probes must be an integer in [2, 256]"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["analyze", "hi there", "--method", "hta", "-o", str(tmp_path / "x.json"), *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err


def test_estimate_memory_is_flat_in_the_probes(tokenizer, monkeypatch):
    """#45 item 21: estimate mode kept every probe's sample ([n, probes, L, B, (H,) n]) and drew every sign at once
    ([n, probes, B, d_in]): `hta.probes=1e8` asked for 1.5 TB. Each pushed chunk now holds at most `chunk`
    directions, the signs are drawn one position at a time, and the running sums are [n, ...] whatever the probes;
    the result is the samples' mean and standard error, with the same signs as one draw."""
    lens = tiny(tokenizer)
    tr = lens.trace(TEXTS[:1])
    b, n, _ = tr.layers[0].x.shape
    d_in = G.input_dim(tr, "word")
    pushed: list[int] = []
    drawn: list[int] = []
    push, randint = G._push, torch.randint
    monkeypatch.setattr(G, "_push", lambda f, p, u: (pushed.append(u.shape[0]), push(f, p, u))[1])
    monkeypatch.setattr(torch, "randint", lambda *a, **k: (r := randint(*a, **k), drawn.append(r.numel()))[0])
    probes = 40
    est = G.jacobian_norms(tr, mode="estimate", probes=probes, seed=1, chunk=8)
    assert max(pushed) <= 8 and sum(pushed) == n * probes
    assert max(drawn) == probes * b * d_in  # one position's signs, never [n, probes, B, d_in]
    monkeypatch.undo()
    signs = torch.randint(0, 2, (n, probes, b, d_in), generator=torch.Generator().manual_seed(1)) * 2 - 1
    u = torch.zeros(n * probes, b, n, d_in)
    k = torch.arange(n * probes)
    u[k, :, k // probes] = signs.reshape(n * probes, b, d_in).float()
    sh, _ = G._push(G.states_fn(tr, "word"), torch.zeros(b, n, d_in), u)  # every sample at once: [n·p, L, B, n]
    sh = sh.reshape(n, probes, *sh.shape[1:]).detach()
    want = sh.mean(1).permute(2, 1, 3, 0)  # [B, L, target, source]
    want_se = (sh.std(1) / probes**0.5).permute(2, 1, 3, 0)
    torch.testing.assert_close(est.hidden, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(est.hidden_se, want_se, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize(
    ("method", "module", "hook", "options"),
    [
        ("hta", "mixlens.methods.gradients", "_push", ["--option", "hta.mode=estimate", "--option", "hta.probes=256"]),
        (
            "integrated_gradients",
            "mixlens.methods.saliency",
            "_forward",
            ["--option", "integrated_gradients.steps=1024", "--option", "integrated_gradients.internal_batch_size=1"],
        ),
    ],
)
def test_ctrl_c_mid_method_ends_the_command_at_once(tokenizer, tmp_path, method, module, hook, options):
    """#45 item 21: `integrated_gradients.steps=20000` ignored Ctrl-C for over 10 s. The work runs in chunks that
    give Python control back: a SIGINT sent once the method has started ends the command within seconds, exit code
    130 and one line."""
    import os
    import signal
    import subprocess
    import sys
    import time

    model = tmp_path / "model"
    lens = tiny(tokenizer)
    lens.model.save_pretrained(model)
    tokenizer.save_pretrained(model)
    started = tmp_path / "started"
    child = (  # a terminal's Ctrl-C: SIGINT handled as Python does by default (a test runner may block or ignore it)
        "import pathlib, sys, importlib, signal\n"
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"m = importlib.import_module({module!r}); real = m.{hook}\n"
        "def hooked(*a, **k):\n"
        f"    pathlib.Path({str(started)!r}).touch()\n"
        "    return real(*a, **k)\n"
        f"m.{hook} = hooked\n"
        "from mixlens.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    text = " ".join(["word"] * 300)
    args = ["analyze", text, "--model", str(model), "--method", method, *options, "-o", str(tmp_path / "out.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", child, *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists() and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else "no start"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        waited = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("mixlens: interrupted") and "Traceback" not in err
    assert waited < 10, f"{waited:.1f} s from SIGINT to exit"  # it ignored Ctrl-C for over 10 s
    assert not (tmp_path / "out.json").exists()
