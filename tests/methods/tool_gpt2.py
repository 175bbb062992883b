"""The random GPT-2 the flow-routes oracle values (tests/data/flow_routes_tool.json) were computed on: weights drawn
from numpy's seeded generator (stable across numpy and torch versions), every bias non-zero (the value bias b_V
included), and the attention and MLP output projections scaled down so that the residual stream stays small
(|x| ~ 1e-2): there the authors' tool's ε inside its distance matters."""

from __future__ import annotations

import numpy as np
import torch
import transformers as T

IDS = [5, 17, 3, 42, 8, 29, 11, 60, 2, 33]  # the input, as token ids (< VOCAB)
VOCAB = 64
SMALL = 0.02  # scale of the embeddings and of the blocks' output projections (W_O, b_O, the MLP's W_out, b_out)


def tool_gpt2() -> T.GPT2LMHeadModel:
    """GPT-2, 3 layers, d = 32, 4 heads, eager attention, weights from numpy's default_rng(2024)."""
    cfg = T.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0)
    model = T.GPT2LMHeadModel(cfg).eval()
    model.config._attn_implementation = "eager"
    rng = np.random.default_rng(2024)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shape = tuple(p.shape)
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                value = 1.0 + 0.3 * rng.standard_normal(shape)
            elif name.endswith(("wte.weight", "wpe.weight")) or ".c_proj." in name:
                value = SMALL * rng.standard_normal(shape)
            elif name.endswith(".bias"):
                value = 0.3 * rng.standard_normal(shape)
            else:
                value = 0.3 * rng.standard_normal(shape)
            p.copy_(torch.from_numpy(value.astype(np.float32)))
    return model
