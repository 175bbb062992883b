"""AttnLRP's memory on a long decoder input: peak RSS of a fresh process per case, on SmolLM2-135M (the real
checkpoint when fetched into ~/.cache/mixlens/models/smollm2-135m-instruct, else a random model of its size).

Cases (each in its own process, after loading the model; peak minus the loaded model is the work's own memory;
`--device cuda`: peak allocated GPU memory instead of RSS):
- `fwd_bwd`: the model's plain forward + backward of the target logit through torch's fused attention (SDPA), the
  floor any gradient method needs;
- `attnlrp`: AttnLRP as mixlens runs it (attention through the fused kernels, each layer recomputed in the
  backward with the rules' hooks live);
- `attnlrp_kept`: the same keeping every layer's activations for the backward (the previous path);
- `attnlrp_eager`: the same with eager attention and every layer kept (each layer's [H, n, n]: the first path);
- `explain_attnlrp`: the public API end to end, `mixlens.explain.explain(lens, text, ["attnlrp"])`;
- `explain3`: `explain(lens, text, ["alti_logit", "attnlrp", "logit_attn"])` (one shared trace, then each
  method); `trace3`: that shared trace alone; `alti_logit`, `logit_attn`: `explain` with each alone.

The model's weights are read once before the baseline is taken (a loaded checkpoint's pages are mapped lazily), so
`work_gib` is the work's own memory. The input is " the" repeated (one token each) after a first word.

Targets (#45): AttnLRP at 8,192 tokens < 4 GB and ≤ 3× `fwd_bwd` (memory and time); `explain3` ≤ the largest method
alone plus the shared trace.

    python benchmarks/bench_attnlrp_memory.py [--tokens 8192] [--dtype float32] [--cases attnlrp,fwd_bwd]
        [--device cuda] [--random]
    OMP_NUM_THREADS=2 python benchmarks/bench_attnlrp_memory.py --tokens 1024,2048,4096,8192 --dtype float32,bfloat16
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
from mixlens.methods import attnlrp, get, saliency
torch.set_num_threads(int({threads}))
dtype = getattr(torch, {dtype!r})
dev = {device!r}
lens, weights = smollm2_lens({dtype!r}, dev, {random})
layers = int({layers})
if layers:  # the first `layers` layers of the model only (a quick look at one layer's cost at long inputs)
    lens.model.model.layers = lens.model.model.layers[:layers]
    lens.model.config.num_hidden_layers = layers
    lens = mixlens.Lens(lens.model, lens.tokenizer, name=f"first-{{layers}}-layers")
n, case = int({n}), {case!r}
text = "Once" + " the" * (n - 1)
enc = lens.encode([text])
enc.inputs.pop("token_type_ids", None)
assert enc.inputs["input_ids"].shape[-1] == n, enc.inputs["input_ids"].shape
with torch.no_grad():
    float(sum(p.float().sum() for p in lens.model.parameters()))  # every weight page resident before the baseline
cuda = dev.startswith("cuda")
if cuda:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() / 2**30
else:
    base = peak_gib()
t0 = time.perf_counter()
if case == "fwd_bwd":
    lens.model.set_attn_implementation("sdpa")
    emb = lens.model.get_input_embeddings()(enc.inputs["input_ids"]).detach().requires_grad_(True)
    logit = lens.model(inputs_embeds=emb, attention_mask=enc.inputs["attention_mask"], logits_to_keep=1).logits
    (g,) = torch.autograd.grad(logit[0, -1].max(), emb)
elif case in ("attnlrp", "attnlrp_kept", "attnlrp_eager"):
    saliency.FUSED_ATTENTION = case != "attnlrp_eager"
    attnlrp.RECOMPUTE_LAYERS = case == "attnlrp"
    get("attnlrp").fn(lens.trace_for(enc, ["attnlrp"]))
elif case == "trace3":
    tr = lens.trace_for(enc, ["alti_logit", "attnlrp", "logit_attn"])  # the shared trace alone
else:
    methods = {{"explain_attnlrp": ["attnlrp"], "explain3": ["alti_logit", "attnlrp", "logit_attn"]}}.get(case, [case])
    from mixlens.explain import explain
    explain(lens, text, methods)
if cuda:
    torch.cuda.synchronize()
dt = time.perf_counter() - t0
print(weights, base, torch.cuda.max_memory_allocated() / 2**30 if cuda else peak_gib(), dt)
"""


def run(case: str, n: int, dtype: str, threads: int, device: str, random: bool, layers: int = 0) -> dict:
    code = CODE.format(
        here=HERE, n=n, case=case, dtype=dtype, threads=threads, device=device, random=random, layers=layers
    )
    res = measured(code)
    if "error" in res:
        return {"case": case, "tokens": n, **res}
    return {
        "case": case,
        "tokens": n,
        "dtype": dtype,
        "device": device,
        **res,
        **({"layers": layers} if layers else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192", help="comma-separated lengths")
    ap.add_argument("--dtype", default="float32", help="comma-separated dtypes")
    ap.add_argument("--cases", default="fwd_bwd,attnlrp,explain_attnlrp")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", default="cpu", help="cpu (peak RSS) or cuda (peak allocated GPU memory)")
    ap.add_argument("--random", action="store_true", help="a random SmolLM2-sized model even when the real one is here")
    ap.add_argument("--layers", type=int, default=0, help="keep only the model's first N layers (0: all)")
    a = ap.parse_args()
    for dtype in a.dtype.split(","):
        for n in (int(t) for t in a.tokens.split(",")):
            for c in a.cases.split(","):
                print(json.dumps(run(c, n, dtype, a.threads, a.device, a.random, a.layers)), flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (other work on the machine slows the times)")


if __name__ == "__main__":
    main()
