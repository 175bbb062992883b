"""Explaining a whole answer: mixlens against one plain forward pass, against backward passes, and against inseq.

A prompt of `--prompt-tokens` tokens (1,024) and an answer of `--answer-tokens` tokens (64) after it, on one causal
LM (SmolLM2-135M-Instruct by default, float32), in one run:

  (a) one plain forward pass of prompt + answer (the model's own forward, all logits, torch's fused attention as
      transformers runs it by default; the eager one beside it), and one backward pass: a forward with the word
      embeddings requiring grad and the backward of one logit at the last position; the ratios below are to these;
  (b) mixlens `logit_attn` of every answer token (its logit; the answer's [answer, source] matrix); target:
      ≤ 2 × one forward;
  (c) mixlens gradient × input of every answer token (its log-probability under teacher forcing, the signed sum
      over the hidden dims: what `explain` computes for an answer); target: ≤ one forward + one backward pass per
      answer token;
  (d) inseq's `input_x_gradient` of the same answer tokens and the same scalar (`attributed_fn="probability"` with
      `logprob=True`, the answer forced with `generated_texts`, its granular attributions summed over the hidden
      dims by inseq's own `sum` aggregator, normalisation off), run by another Python (`--inseq-python`, default
      `$MIXLENS_INSEQ_PYTHON`: a virtual environment with inseq and the same torch), timed inside that process;
      goal: (c) ≤ 0.5 × (d). The matrices of (c) and (d) are asserted equal where both define a value (inseq leaves
      the tokens after each step's prefix NaN): `same` (≤ 1e-5 of the largest value, float32).

mixlens runs through the public answer API, `explain(lens, prompt, [method], answer=ANSWER)`. Model loading is
excluded on both sides, and both sides first run once on a short input (warm-up). Times are wall clock, the process
CPU time in brackets (the steadier one on a shared machine), with the load average; each side runs once
(`--repeats` for more, the median is kept).

`--steps K` (< answer tokens) explains only the first K answer tokens with gradient × input and inseq (the answer
given to both is then its first K tokens): a quick run, both sides doing the same K tokens. The ratio at K tokens is
an upper bound of the ratio at the whole answer (mixlens' one forward pass is shared by fewer tokens); the 64-token
times are printed as estimates scaled by answer/K. Threads: `--threads` (default 1) for torch in both processes,
the child's OMP_NUM_THREADS too (the machine of docs/performance.md has 2 cores shared with other jobs).

    python benchmarks/bench_answers_vs_inseq.py [--model PATH] [--prompt-tokens 1024] [--answer-tokens 64]
        [--steps K] [--threads 1] [--inseq-python PATH] [--skip forward logit_attn grad_x_input inseq]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODELS = Path(os.environ.get("MIXLENS_MODELS", Path.home() / ".cache" / "mixlens" / "models")).expanduser()
SMOLLM2 = MODELS / "smollm2-135m-instruct"  # scripts/fetch_models.py smollm2-135m-instruct
SIDES = ("forward", "logit_attn", "grad_x_input", "inseq")
TOLERANCE = 1e-5  # float32: |ours − inseq's| ≤ TOLERANCE · max(1, the largest |value|) (values reach ≈ 6 on SmolLM2)
PASSAGE = (
    "The archive room is on the third floor of the old library, behind the reading hall. Its access code was changed "
    "last spring, after the inventory found that several maps had been moved to the wrong shelves. The librarian "
    "keeps a list of every visitor, the time they came in and the boxes they asked for. On rainy days the room is "
    "closed early, because the roof above the east wing still leaks and the staff cover the cases with sheets."
).split()

# Run by the inseq interpreter: argv[1] is a JSON file with the request; prints one JSON line.
INSEQ_SCRIPT = r"""
import json, os, sys, time
spec = json.load(open(sys.argv[1]))
import torch
torch.set_num_threads(spec["threads"])
import inseq

model = inseq.load_model(spec["model"], "input_x_gradient", model_kwargs={"dtype": torch.float32})


def run(prompt, answer, steps):
    n = len(model.encode(prompt).input_ids[0])
    fn = {"logit": {"attributed_fn": "logit"}, "logprob": {"attributed_fn": "probability", "logprob": True}}
    return model.attribute(prompt, prompt + answer, show_progress=False, attr_pos_end=n + steps, **fn[spec["fn"]])


run(spec["warmup"][0], spec["warmup"][1], 1)  # lazy initialisation, untimed
walls, cpus = [], []
for _ in range(spec["repeats"]):
    t0, c0 = time.perf_counter(), time.process_time()
    out = run(spec["prompt"], spec["answer"], spec["steps"])
    walls.append(time.perf_counter() - t0)
    cpus.append(time.process_time() - c0)
seq = out.sequence_attributions[0]
from importlib.metadata import version
res = {"wall": walls, "cpu": cpus, "ids": [t.id for t in seq.target], "inseq": version("inseq"),
       "transformers": version("transformers"), "torch": torch.__version__}
for name, fn in (("sum", "sum"), ("l2", "vnorm")):
    agg = seq.aggregate(fn, normalize=False).target_attributions  # [prefix + answer, steps]
    res[name] = [[None if v != v else v for v in row] for row in agg.T.tolist()]  # [steps, tokens], NaN -> None
print(json.dumps(res))
"""


def inseq_attributions(
    python: str,
    model: str,
    prompt: str,
    answer: str,
    steps: int,
    fn: str = "logprob",
    threads: int = 1,
    repeats: int = 1,
) -> dict[str, Any]:
    """inseq's input_x_gradient of the first `steps` tokens of `answer` after `prompt` for the scalar `fn` ('logit'
    or 'logprob' of each answer token), run by `python` (another interpreter with inseq): {'wall', 'cpu': seconds per
    repeat, 'ids': the token ids of prompt + answer, 'sum', 'l2': [steps, tokens] arrays (NaN after each step's
    prefix), versions}."""
    with tempfile.TemporaryDirectory(prefix="mixlens-inseq-") as tmp:
        script, request = Path(tmp) / "inseq_side.py", Path(tmp) / "request.json"
        script.write_text(INSEQ_SCRIPT)
        warmup = (" ".join(PASSAGE[:12]), " " + " ".join(PASSAGE[12:14]))
        spec = {"model": model, "prompt": prompt, "answer": answer, "steps": steps, "threads": threads, "fn": fn}
        request.write_text(json.dumps(spec | {"repeats": repeats, "warmup": warmup}))
        env = os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)  # inseq's environment, not this one's
        run = subprocess.run([python, str(script), str(request)], capture_output=True, text=True, env=env, cwd=tmp)
    if run.returncode != 0:
        raise RuntimeError(f"the inseq side failed:\n{run.stderr[-3000:]}")
    res = json.loads(run.stdout.strip().splitlines()[-1])
    for k in ("sum", "l2"):
        res[k] = np.array([[np.nan if v is None else v for v in row] for row in res[k]], dtype=np.float64)
    return res


def same(ours: np.ndarray, theirs: np.ndarray) -> tuple[bool, float, float]:
    """(equal?, max |ours − theirs|, the scale): ours [answer, ≥ tokens] against inseq's [answer, tokens] where inseq
    defines a value; equal when the largest difference is ≤ TOLERANCE · max(1, max |theirs|) (float32 rounding of
    two different forward passes: inseq's prefix only, ours the whole text with the logits at one position)."""
    both = ~np.isnan(theirs)
    diff = float(np.abs(ours[:, : theirs.shape[1]][both] - theirs[both]).max())
    scale = max(1.0, float(np.abs(theirs[both]).max()))
    return diff <= TOLERANCE * scale, diff, scale


def prompt_and_answer(lens, prompt_tokens: int, answer_tokens: int) -> tuple[str, str, list[int], list[int]]:
    """(prompt, answer, prompt ids, answer ids): a prompt of exactly `prompt_tokens` tokens (with the tokenizer's
    special tokens) and an answer of `answer_tokens` that tokenize the same alone and appended to the prompt."""
    words = [PASSAGE[i % len(PASSAGE)] for i in range(2 * (prompt_tokens + answer_tokens) + 16)]
    ids = lens.encode([" ".join(words)], max_length=prompt_tokens + answer_tokens + 8).inputs["input_ids"][0].tolist()
    special = set(lens.tokenizer.all_special_ids)
    lead = 0
    while lead < len(ids) and ids[lead] in special:
        lead += 1
    body = ids[lead:]
    cut = prompt_tokens - lead
    while not lens.tokenizer.convert_ids_to_tokens(body[cut]).startswith(("Ġ", "▁")):  # answer starts a word
        cut -= 1
    prompt = lens.tokenizer.decode(body[:cut])
    answer = lens.tokenizer.decode(body[cut : cut + answer_tokens])
    p_ids = lens.encode([prompt]).inputs["input_ids"][0].tolist()
    both = lens.encode([prompt + answer]).inputs["input_ids"][0].tolist()
    if both[: len(p_ids)] != p_ids or len(both) != len(p_ids) + answer_tokens:
        raise RuntimeError("the answer does not tokenize the same after the prompt; pick another text")
    return prompt, answer, p_ids, both[len(p_ids) :]


def answer_matrix(lens, method: str, prompt: str, answer: str) -> np.ndarray:
    """mixlens' [answer token, source] scores of `method` for `answer` after `prompt`, through the public answer API
    (`explain(lens, prompt, [method], answer=answer)`)."""
    from mixlens.explain import explain

    return np.asarray(explain(lens, prompt, [method], answer=answer).attributions[method].input(0), dtype=np.float64)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float, float, float]:
    """(the last result, median wall seconds, median process CPU seconds, load average after)."""
    walls, cpus, res = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        res = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return res, statistics.median(walls), statistics.median(cpus), os.getloadavg()[0]


def forward_and_backward(lens, ids: list[int], repeats: int) -> dict[str, tuple[float, float]]:
    """(wall, CPU) seconds of: 'sdpa' one plain forward of `ids` (the model's own forward, all logits, no grad) with
    torch's fused attention, transformers' default and what inseq runs; 'eager' the same with eager attention (how
    mixlens loads a model); 'backward' the backward of one logit at the last position after a forward (fused
    attention) whose word embeddings require grad (only the last position's logits where the model takes
    `logits_to_keep`). Medians of `repeats`; the model is left in eager attention."""
    from mixlens.methods.saliency import keeps_logits

    x = torch.tensor([ids], device=lens.device)
    keep = {"logits_to_keep": 1} if keeps_logits(lens.model) else {}

    def plain() -> None:
        with torch.no_grad():
            lens.model(input_ids=x)

    out: dict[str, tuple[float, float]] = {}
    try:
        for impl in ("eager", "sdpa"):
            lens.model.set_attn_implementation(impl)
            out[impl] = timed(plain, repeats)[1:3]
        bwds, bcpus = [], []
        for _ in range(repeats):
            emb = lens.model.get_input_embeddings()(x).detach().requires_grad_()
            logit = lens.model(inputs_embeds=emb, **keep).logits[0, -1, ids[-1]]
            t0, c0 = time.perf_counter(), time.process_time()
            logit.backward()
            bwds.append(time.perf_counter() - t0)
            bcpus.append(time.process_time() - c0)
        out["backward"] = statistics.median(bwds), statistics.median(bcpus)
    finally:
        lens.model.set_attn_implementation("eager")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(SMOLLM2), help="a causal LM folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=None, help="explain only the first K answer tokens (quick run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in both processes")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--inseq-python", default=os.environ.get("MIXLENS_INSEQ_PYTHON"), help="a Python with inseq")
    ap.add_argument("--skip", nargs="*", default=[], choices=SIDES)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import mixlens

    lens = mixlens.load(a.model, dtype="float32")
    prompt, answer, p_ids, a_ids = prompt_and_answer(lens, a.prompt_tokens, a.answer_tokens)
    steps = min(a.steps or len(a_ids), len(a_ids))
    part = lens.tokenizer.decode(a_ids[:steps])  # the explained part of the answer
    scale = len(a_ids) / steps
    print(
        f"{lens.name}: prompt {len(p_ids)} tokens + answer {len(a_ids)} tokens; "
        f"torch threads {a.threads}; "
        f"gradient sides explain {steps} of {len(a_ids)} answer tokens; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    short = (" ".join(PASSAGE[:12]), " " + " ".join(PASSAGE[12:14]))
    fwd = bwd = fwd_cpu = bwd_cpu = None
    if "forward" not in a.skip:
        ref = forward_and_backward(lens, p_ids + a_ids, max(2, a.repeats))
        (fwd, fwd_cpu), (bwd, bwd_cpu) = ref["sdpa"], ref["backward"]
        print(
            f"(a) one forward of {len(p_ids) + len(a_ids)} tokens: {fwd:.2f} s [{fwd_cpu:.2f}] (fused attention; "
            f"eager: {ref['eager'][0]:.2f} s [{ref['eager'][1]:.2f}]); one backward pass (one logit): {bwd:.2f} s "
            f"[{bwd_cpu:.2f}]; load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    ours = None
    for method in ("logit_attn", "grad_x_input"):
        if method in a.skip:
            continue
        k = len(a_ids) if method == "logit_attn" else steps  # logit_attn: the whole answer from one forward
        answer_matrix(lens, method, *short)  # warm-up
        text = lens.tokenizer.decode(a_ids[:k])
        mat, wall, cpu, load = timed(partial(answer_matrix, lens, method, prompt, text), a.repeats)
        assert mat.shape == (k, len(p_ids) + k), mat.shape
        est = wall * len(a_ids) / k  # an upper bound: the forward pass is not repeated per token
        label = "(b)" if method == "logit_attn" else "(c)"
        line = f"{label} mixlens {method}, {k} answer tokens: {wall:.2f} s [{cpu:.2f}]"
        if k < len(a_ids):
            line += (
                f"; ×{len(a_ids) / k:.0f} → {len(a_ids)} tokens ≤ {est:.1f} s (its forward counted ×{len(a_ids) // k})"
            )
        if fwd is not None and bwd is not None and fwd_cpu is not None and bwd_cpu is not None:
            if method == "logit_attn":
                line += f"; {wall / fwd:.2f} [CPU {cpu / fwd_cpu:.2f}] × one forward (target ≤ 2)"
            else:
                budget, budget_cpu = fwd + k * bwd, fwd_cpu + k * bwd_cpu
                line += (
                    f"; {wall / budget:.2f} [CPU {cpu / budget_cpu:.2f}] × (one forward + {k} backward passes) "
                    "(target ≤ 1)"
                )
        print(f"{line}; load {load:.1f}", flush=True)
        if method == "grad_x_input":
            ours = (mat, wall, cpu)
    if "inseq" in a.skip:
        return
    if not a.inseq_python:
        print("(d) inseq: skipped (give --inseq-python or set MIXLENS_INSEQ_PYTHON)")
        return
    res = inseq_attributions(a.inseq_python, a.model, prompt, part, steps, "logprob", a.threads, a.repeats)
    if res["ids"] != p_ids + a_ids[:steps]:
        raise RuntimeError("inseq tokenized prompt + answer differently")
    wall, cpu = statistics.median(res["wall"]), statistics.median(res["cpu"])
    line = (
        f"(d) inseq {res['inseq']} input_x_gradient (transformers {res['transformers']}, torch {res['torch']}), "
        f"{steps} answer tokens: {wall:.2f} s [{cpu:.2f}]"
    )
    if steps < len(a_ids):
        line += f"; ×{scale:.0f} → {len(a_ids)} tokens ≈ {wall * scale:.1f} s"
    print(f"{line}; load {os.getloadavg()[0]:.1f}", flush=True)
    if ours is None:
        return
    mat, o_wall, o_cpu = ours
    ok, diff, scale = same(mat, res["sum"])
    print(
        f"(c)/(d) mixlens / inseq, the same {steps} answer tokens: {o_wall / wall:.2f} [CPU {o_cpu / cpu:.2f}] "
        f"(goal ≤ 0.5); gradient × input: max |diff| {diff:.1e} {'≤' if ok else '>'} {TOLERANCE:g} × {scale:.2f} "
        f"(the largest |value|)",
        flush=True,
    )
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
