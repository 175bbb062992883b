"""Peak resident memory of this process, for the benchmarks and the fresh processes they spawn (which put this
folder on `sys.path` and import it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)  # this folder, for a spawned process's sys.path


def peak_gib() -> float:
    """Peak RSS of this process in GiB: VmHWM, not ru_maxrss (on Linux a spawned child's ru_maxrss starts at its
    parent's peak)."""
    with Path("/proc/self/status").open() as fh:
        return int(next(x for x in fh if x.startswith("VmHWM")).split()[1]) / 2**20


def measured(code: str) -> dict[str, object]:
    """Run a benchmark's child `code` (which prints `weights base_gib peak_gib seconds` last) in a fresh process:
    {weights, model_loaded_gib, peak_gib, work_gib, seconds}, or {error: the child's last error line}."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        lines = [x for x in out.stderr.splitlines() if "rror" in x] or out.stderr.strip().splitlines()
        return {"error": (lines or [f"exit {out.returncode}"])[-1][:300]}
    weights, base, peak, dt = out.stdout.split()[-4:]
    return {
        "weights": weights,
        "model_loaded_gib": round(float(base), 3),
        "peak_gib": round(float(peak), 3),
        "work_gib": round(float(peak) - float(base), 3),
        "seconds": round(float(dt), 2),
    }


def smollm2_lens(dtype: str = "float32", device: str = "cpu", random: bool = False) -> tuple[object, str]:
    """(lens, 'real' | 'random'): SmolLM2-135M-Instruct from ~/.cache/mixlens/models when it is there (and not
    `random`), else a random model of its shape on the bundled tokenizer; in `dtype`, on `device`."""
    import torch
    import transformers as T

    import mixlens

    path = Path.home() / ".cache/mixlens/models/smollm2-135m-instruct"
    if (path / "config.json").is_file() and not random:
        return mixlens.load(str(path), dtype=dtype, device=device), "real"
    tok = T.AutoTokenizer.from_pretrained(mixlens.lens.default_model_path())
    cfg = T.LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=tok.vocab_size,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(getattr(torch, dtype))
    return mixlens.Lens(model.to(device).eval(), tok, name="random-smollm2"), "random"
