"""Explaining a whole answer: time and peak memory of `explain(..., answer=)`'s core (`answers.explain_answer`)
against one plain forward of prompt + answer, on SmolLM2-135M (the real checkpoint when fetched into
~/.cache/mixlens/models/smollm2-135m-instruct, else a random model of its size). One fresh process per case; peak
RSS is the process's VmHWM (`rss.peak_gib`), reported whole and minus the loaded model.

Cases: `forward` (the model's plain forward of prompt + answer, no gradient: the reference), and any explain
method names, each alone (`logit_attn`, `alti_logit`, `grad_x_input`, `attnlrp`, `alti_rollout`, ...), or several
methods explained together joined by `+` (`norm+norm_res+norm_resln+norm_rollout+norm_res_rollout+
norm_resln_rollout+logit_attn`: one `explain_answer` call, as `explain --method ... --method ...` runs them).

Targets (docs/performance.md): `logit_attn` ≤ 2× one forward at 1,024 + 64 tokens; 8,192 + 32 tokens with
`logit_attn` < 4 GB peak RSS.

    python benchmarks/bench_answers.py [--prompt 1024] [--answer 64] [--cases forward,logit_attn,grad_x_input]
        [--threads 2] [--dtype float32] [--random]
"""

from __future__ import annotations

import argparse
import json
import os

from rss import HERE, measured

CODE = """
import sys, time, torch
sys.path.insert(0, {here!r})
from pathlib import Path
from rss import peak_gib, smollm2_lens
from transformers.utils import logging
logging.set_verbosity_error()
import transformers as T, mixlens
from mixlens.explain.answers import Answer, explain_answer
torch.set_num_threads(int({threads}))
lens, weights = smollm2_lens({dtype!r}, "cpu", {random})
p, m, case = int({prompt}), int({answer}), {case!r}
ids = [(7 * i) % 1000 + 100 for i in range(p + m)]
answer = Answer("", ids[p:], [""] * m, p)
base = peak_gib()
t0 = time.perf_counter()
if case == "forward":
    with torch.no_grad():
        lens.model(**lens.encode_ids([ids]).inputs)
else:
    explain_answer(lens, ids, answer, case.split("+"))
dt = time.perf_counter() - t0
print(weights, base, peak_gib(), dt)
"""


def run(case: str, prompt: int, answer: int, dtype: str, threads: int, random: bool) -> dict:
    code = CODE.format(here=HERE, prompt=prompt, answer=answer, case=case, dtype=dtype, threads=threads, random=random)
    res = measured(code)
    if "error" in res:
        return {"case": case, **res}
    return {"case": case, "prompt": prompt, "answer": answer, "dtype": dtype, **res}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--cases", default="forward,logit_attn", help="comma-separated; methods together: a+b+c")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--random", action="store_true", help="a random SmolLM2-sized model even when the real one is here")
    a = ap.parse_args()
    rows = [run(c, a.prompt, a.answer, a.dtype, a.threads, a.random) for c in a.cases.split(",")]
    forward = next((r["seconds"] for r in rows if r.get("case") == "forward" and "seconds" in r), None)
    for r in rows:
        if forward and "seconds" in r:
            r["x_forward"] = round(r["seconds"] / forward, 2)
        print(json.dumps(r))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (other work on the machine slows the times)")


if __name__ == "__main__":
    main()
