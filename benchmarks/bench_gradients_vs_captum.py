"""Gradient methods through the public API vs captum on the same embedding-level function.

`lens.analyze(texts, [method])` end to end (tokenize, batch, attribute, build the result) against captum's
`Saliency(abs=False)` / `InputXGradient` / `IntegratedGradients` (same steps, same chunk of input × step rows, no
convergence delta) on f(E) = target(model(inputs_embeds=E)) with the same tokenisation, timed; the target ids
are computed beforehand and untimed for captum (mixlens resolves 'pred' inside its timed call). The model is
loaded once, untimed. Per case and method, the two sides alternate (which one goes first alternates too) and the
medians are compared; the numbers are asserted equal (allclose). Prints the ratio (target ≤ 1.1) and the load
average (the machine may be shared). Cases: `--inputs` short inputs (8–40 words) in one batch, and one input of
each `--tokens` length. `--ig-memory` instead measures the peak RSS of integrated gradients on one long input,
unchunked (all steps in one pass) vs chunked (the default).

    python benchmarks/bench_gradients_vs_captum.py [--model PATH] [--repeats 5] [--tokens 234] [--steps 50]
    python benchmarks/bench_gradients_vs_captum.py --ig-memory [--model PATH] [--tokens 234] [--chunked-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from rss import HERE

WORDS = "the film was a quiet , moving and often very funny look at two old friends who meet again".split()
METHODS = ("saliency", "grad_x_input", "integrated_gradients")


def texts(n: int, lo: int, hi: int) -> list[str]:
    return [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(lo + (i * 7) % (hi - lo))) for i in range(n)]


def long_text(lens, tokens: int) -> str:
    """A text of exactly `tokens` tokens (with the tokenizer's special tokens)."""
    words = [WORDS[i % len(WORDS)] for i in range(2 * tokens)]
    ids = lens.encode([" ".join(words)], max_length=tokens).inputs["input_ids"][0]
    special = set(lens.tokenizer.all_special_ids)
    return lens.tokenizer.decode([int(i) for i in ids if int(i) not in special]).strip()


def _target(lens, enc) -> tuple:
    """(pick(out, *extra) -> [R] for captum, its per-input extra tensors [B], the same target as a mixlens option):
    the predicted logit, or for a model without a head the norm of the first token's last hidden state. The extra
    tensors travel with captum's step expansion."""
    inputs = enc.inputs
    with torch.no_grad():
        out = lens.model(**inputs)
    logits = getattr(out, "logits", None)
    if logits is None:

        def hidden(o, _inputs=None):
            return o.last_hidden_state[:, 0].norm(dim=-1)

        return hidden, (), hidden
    if logits.dim() == 2:
        return (lambda o, c: o.logits.gather(1, c[:, None])[:, 0]), (logits.argmax(-1),), "pred"
    last = inputs["attention_mask"].sum(-1) - 1
    tok = logits[torch.arange(len(last)), last].argmax(-1)
    return (lambda o, p, t: o.logits[torch.arange(len(p)), p, t]), (last, tok), "pred"


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int
) -> tuple[dict[str, float], dict[str, float], dict[str, object]]:
    """Median wall and process-CPU seconds per side over `repeats` rounds, the sides alternating (and which goes
    first), after a warm-up of each; and each side's last result. (CPU time is the steadier one on a loaded
    machine; with several torch threads it also counts their spinning.)"""
    res = {k: fn() for k, fn in fns.items()}  # warm-up
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats):
        for k in list(fns)[:: 1 if r % 2 == 0 else -1]:
            t0, c0 = time.perf_counter(), time.process_time()
            res[k] = fns[k]()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    med = statistics.median
    return {k: med(t) for k, t in wall.items()}, {k: med(t) for k, t in cpu.items()}, res


def speed(model: str | None, n: int, lengths: list[int], methods: list[str], steps: int, repeats: int) -> None:
    import mixlens

    lens = mixlens.load(model)
    print(
        f"{lens.name}: torch threads {torch.get_num_threads()}, {repeats} interleaved repeats, load "
        f"{os.getloadavg()[0]:.1f}"
    )
    cases = [(f"{n} inputs", texts(n, 8, 40))] + [(f"{t} tokens", [long_text(lens, t)]) for t in lengths]
    for label, batch in cases:
        for method in methods:
            compare(lens, label, batch, method, steps, repeats)


def compare(lens, label: str, batch: list[str], method: str, steps: int, repeats: int) -> None:
    """Time `lens.analyze(batch, [method])` against captum on the same batch; assert equal numbers."""
    from captum.attr import InputXGradient, IntegratedGradients, Saliency

    from mixlens.methods.saliency import IG_TOKENS_PER_CHUNK

    embed = lens.model.get_input_embeddings()
    enc = lens.encode(batch)
    pick, extra, target = _target(lens, enc)
    mask = enc.inputs["attention_mask"]
    b, tokens = mask.shape
    rows = min(b * steps, max(b, IG_TOKENS_PER_CHUNK // tokens // b * b))  # IG chunk (mixlens' default)
    opts: dict[str, object] = {"target": target}
    if method == "integrated_gradients":
        opts |= {"steps": steps, "internal_batch_size": rows}

    def f(emb: torch.Tensor, m: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
        return pick(lens.model(inputs_embeds=emb, attention_mask=m), *more)

    def ours():
        return lens.analyze(batch, [method], batch_size=b, options={method: opts})

    def theirs():
        e = lens.encode(batch)
        with torch.no_grad():
            emb = embed(e.inputs["input_ids"])
        args = (e.inputs["attention_mask"], *extra)  # travel with captum's step expansion
        if method == "saliency":
            return Saliency(f).attribute(emb, additional_forward_args=args, abs=False)
        if method == "grad_x_input":
            return InputXGradient(f).attribute(emb, additional_forward_args=args)
        return IntegratedGradients(f).attribute(
            emb, additional_forward_args=args, n_steps=steps, internal_batch_size=rows
        )

    t, c, res = interleaved({"mixlens": ours, "captum": theirs}, repeats)
    an, raw = res["mixlens"], res["captum"]
    ref = raw.norm(dim=-1) * mask
    for k in range(b):
        m = len(an.tokens[k])
        torch.testing.assert_close(torch.from_numpy(an[method].values[k, :m]), ref[k, :m], atol=1e-5, rtol=1e-3)
    print(
        f"{label} ({b}×{tokens}) {method}: mixlens {t['mixlens'] * 1e3:.0f} ms, captum {t['captum'] * 1e3:.0f} ms, "
        f"ratio {t['mixlens'] / t['captum']:.2f} (CPU time {c['mixlens'] / c['captum']:.2f}); numbers equal; "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )


IG_CODE = """
import sys, torch, mixlens
sys.path.insert(0, {here!r})
from rss import peak_gib
from mixlens.methods.saliency import output_attribution
lens = mixlens.load({model!r})
words = "the film was a quiet , moving and often very funny look at two old friends who meet again".split()
text = " ".join(words[i % len(words)] for i in range(2 * {tokens}))
enc = lens.encode([text], max_length={tokens})
target = "pred" if getattr(lens.model(**enc.inputs), "logits", None) is not None else \\
    (lambda o, i: o.last_hidden_state[:, 0].norm(dim=-1))
tr = lens.trace(enc)
base = peak_gib()
rows = {rows}
res = output_attribution(tr, "integrated_gradients", target=target, steps={steps}, internal_batch_size=rows)
print(base, peak_gib(), float(res.delta.abs().max()))
"""


def ig_memory(model: str | None, tokens: int, steps: int, chunked_only: bool) -> None:
    for label, rows in (("unchunked", steps), ("chunked (default)", None))[chunked_only:]:
        out = subprocess.run(
            [sys.executable, "-c", IG_CODE.format(here=HERE, model=model, tokens=tokens, steps=steps, rows=rows)],
            capture_output=True,
            text=True,
            check=True,
        )
        base, peak, delta = map(float, out.stdout.split()[-3:])
        print(
            f"{model or 'all-MiniLM-L6-v2'} IG {tokens} tokens × {steps} steps, {label}: peak RSS {peak:.2f} GiB "
            f"(model loaded and traced {base:.2f}), |delta| {delta:.2e}, load {os.getloadavg()[0]:.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model path (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--inputs", type=int, default=8, help="short inputs in the batch case")
    ap.add_argument("--tokens", type=int, nargs="*", default=[234], help="long single-input cases (token counts)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--ig-memory", action="store_true")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--chunked-only", action="store_true", help="skip the unchunked run (it may need > 10 GB)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.ig_memory:
        for t in a.tokens:
            ig_memory(a.model, t, a.steps, a.chunked_only)
    else:
        speed(a.model, a.inputs, a.tokens, a.methods, a.steps, a.repeats)


if __name__ == "__main__":
    main()
