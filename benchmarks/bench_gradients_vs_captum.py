"""Gradient methods through the public API vs captum on the same embedding-level function.

`lens.analyze(texts, [method])` end to end (tokenize, batch, attribute, build the result) against captum's
`Saliency(abs=False)` / `InputXGradient` on f(E) = target(model(inputs_embeds=E)), with the target ids computed
beforehand and untimed for captum. Asserts that the numbers agree, prints the median time of each side, their
ratio (target ≤ 1.1) and the load average (the machine may be shared). `--ig-memory` instead measures the peak
RSS of integrated gradients on one long input, unchunked (all steps in one pass) vs chunked (the default).

    python benchmarks/bench_gradients_vs_captum.py [--model PATH] [--repeats 5]
    python benchmarks/bench_gradients_vs_captum.py --ig-memory [--model PATH] [--tokens 234] [--chunked-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

WORDS = "the film was a quiet , moving and often very funny look at two old friends who meet again".split()


def texts(n: int, lo: int, hi: int) -> list[str]:
    return [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(lo + (i * 7) % (hi - lo))) for i in range(n)]


def _target(lens, enc) -> tuple:
    """(target(out) -> [B] for captum, the same target as a mixlens option): the predicted logit, or for a model
    without a head the norm of the first token's last hidden state."""
    inputs = enc.inputs
    with torch.no_grad():
        out = lens.model(**inputs)
    logits = getattr(out, "logits", None)
    if logits is None:
        def hidden(o, _inputs=None):
            return o.last_hidden_state[:, 0].norm(dim=-1)

        return hidden, hidden
    if logits.dim() == 2:
        cls = logits.argmax(-1)
        return (lambda o: o.logits.gather(1, cls[:, None])[:, 0]), "pred"
    last = inputs["attention_mask"].sum(-1) - 1
    tok = logits[torch.arange(len(last)), last].argmax(-1)
    return (lambda o: o.logits[torch.arange(len(last)), last, tok]), "pred"


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, res = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), res


def speed(model: str | None, n: int, repeats: int) -> None:
    from captum.attr import InputXGradient, Saliency

    import mixlens

    lens = mixlens.load(model)
    batch = texts(n, 8, 40)
    enc = lens.encode(batch)
    pick, target = _target(lens, enc)
    mask = enc.inputs["attention_mask"]
    embed = lens.model.get_input_embeddings()

    def f(emb: torch.Tensor) -> torch.Tensor:
        return pick(lens.model(inputs_embeds=emb, attention_mask=mask))

    for method, cls in (("saliency", Saliency), ("grad_x_input", InputXGradient)):
        def ours(method=method):
            return lens.analyze(batch, [method], batch_size=n, options={method: {"target": target}})

        def theirs(cls=cls):
            e = lens.encode(batch)
            with torch.no_grad():
                emb = embed(e.inputs["input_ids"])
            return cls(f).attribute(emb, abs=False) if cls is Saliency else cls(f).attribute(emb)

        t_ours, an = timed(ours, repeats)
        load_ours = os.getloadavg()[0]
        t_cap, raw = timed(theirs, repeats)
        load_cap = os.getloadavg()[0]
        ref = raw.norm(dim=-1) * mask
        for b in range(n):
            k = len(an.tokens[b])
            torch.testing.assert_close(torch.from_numpy(an[method].values[b, :k]), ref[b, :k], atol=1e-5, rtol=1e-3)
        print(f"{lens.name} {method}: {n} inputs, mixlens {t_ours * 1e3:.0f} ms (load {load_ours:.1f}), captum "
              f"{t_cap * 1e3:.0f} ms (load {load_cap:.1f}), ratio {t_ours / t_cap:.2f}; numbers equal")


IG_CODE = """
import resource, sys, torch, mixlens
from mixlens.methods.saliency import output_attribution
lens = mixlens.load({model!r})
words = "the film was a quiet , moving and often very funny look at two old friends who meet again".split()
text = " ".join(words[i % len(words)] for i in range(2 * {tokens}))
enc = lens.encode([text], max_length={tokens})
target = "pred" if getattr(lens.model(**enc.inputs), "logits", None) is not None else \\
    (lambda o, i: o.last_hidden_state[:, 0].norm(dim=-1))
tr = lens.trace(enc)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
rows = {rows}
res = output_attribution(tr, "integrated_gradients", target=target, steps={steps}, internal_batch_size=rows)
print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, float(res.delta.abs().max()))
"""


def ig_memory(model: str | None, tokens: int, steps: int, chunked_only: bool) -> None:
    for label, rows in (("unchunked", steps), ("chunked (default)", None))[chunked_only:]:
        out = subprocess.run([sys.executable, "-c", IG_CODE.format(model=model, tokens=tokens, steps=steps, rows=rows)],
                             capture_output=True, text=True, check=True)
        base, peak, delta = map(float, out.stdout.split()[-3:])
        print(f"{model or 'all-MiniLM-L6-v2'} IG {tokens} tokens × {steps} steps, {label}: peak RSS {peak:.2f} GiB "
              f"(model loaded and traced {base:.2f}), |delta| {delta:.2e}, load {os.getloadavg()[0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model path (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--inputs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ig-memory", action="store_true")
    ap.add_argument("--tokens", type=int, default=234)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--chunked-only", action="store_true", help="skip the unchunked run (it may need > 10 GB)")
    a = ap.parse_args()
    if a.ig_memory:
        ig_memory(a.model, a.tokens, a.steps, a.chunked_only)
    else:
        speed(a.model, a.inputs, a.repeats)


if __name__ == "__main__":
    main()
