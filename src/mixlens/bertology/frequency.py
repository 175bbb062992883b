"""Word frequency against context mixing (Kobayashi et al. 2021, §5), with real word frequencies.

Frequencies come from `wordfreq` (offline lists built from large corpora, not counts over the analysed
data): the Zipf frequency of the token's *word* (log10 of occurrences per billion words). Subword pieces
take the frequency of the whole word they belong to (the tokenizer's word ids; the word string is the
tokenizer's own detokenisation of its pieces). Special tokens are left out, and so are words `wordfreq`
does not know (Zipf 0: mostly punctuation and rare strings); the count of both is reported.

Per layer and real token i, from the norm engine (DESIGN §3.3–3.4):
- `ratio`: the ResLN-N context-mixing ratio r_i = c_i / (c_i + s_i);
- `self`: s_i = ‖g_i(t_ii)‖ (the N-ResLN diagonal), the norm of the token's own contribution;
- `context`: c_i = ‖Σ_{j≠i} g_i(t_ij)‖ = r_i s_i / (1 − r_i), the norm of the summed context contribution.
Reported: the Spearman ρ between Zipf frequency and each of them, per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from mixlens.errors import MixlensError, optional_import
from mixlens.trace import Trace

if TYPE_CHECKING:
    from mixlens.lens import Encoded

QUANTITIES = ("ratio", "self", "context")


def zipf(word: str, lang: str = "en") -> float:
    """Zipf frequency of a word from `wordfreq` (0 for unknown words)."""
    return float(optional_import("wordfreq", "studies").zipf_frequency(word, lang))


def _traces(lens, texts: Sequence[str], batch_size: int, max_length: int | None) -> Iterator[tuple[Encoded, Trace]]:
    """(encoded batch, trace) per batch, the trace up to the last attention block (what the norm engine reads)."""
    for batch in lens.batches(list(texts), batch_size, max_length, trace=["norm"]):
        yield batch.enc, batch.trace


def token_norms(trace) -> dict[str, torch.Tensor]:
    """ratio, self and context (module docstring) per token: each [B, L, n], padding 0."""
    from mixlens.methods.engine import block_norms

    bn = block_norms(trace)
    r = bn.ratio["ResLN-N"]
    s = bn.n_resln.diagonal(dim1=-2, dim2=-1)
    c = torch.where(r < 1, r * s / (1 - r).clamp_min(torch.finfo(r.dtype).tiny), 0)
    return {"ratio": r, "self": s, "context": c}


@dataclass
class FrequencyReport:
    """`tokens`: one row per scored token (input, position, word, zipf, then per layer l the columns
    `ratio_l`, `self_l`, `context_l`); `rho`: per layer the Spearman ρ of zipf with each quantity."""

    tokens: pd.DataFrame
    rho: pd.DataFrame
    n_layers: int
    left_out: int


def frequency_study(
    lens,
    texts: Sequence[str],
    *,
    lang: str = "en",
    batch_size: int = 32,
    max_length: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> FrequencyReport:
    """Per-token word frequency and mixing quantities over `texts`, and their per-layer Spearman ρ."""
    from scipy.stats import spearmanr

    if not texts:
        raise MixlensError("no input text given")
    cache: dict[str, float] = {}
    rows, left_out, n_layers, index = [], 0, 0, 0
    for enc, tr in _traces(lens, texts, batch_size, max_length):
        q = {k: v.cpu().numpy() for k, v in token_norms(tr).items()}
        n_layers = q["ratio"].shape[1]
        for b, (toks, wids) in enumerate(zip(enc.tokens, enc.words, strict=True)):
            pieces: dict[int, list[str]] = {}
            for t, w in zip(toks, wids, strict=True):
                if w is not None:
                    pieces.setdefault(w, []).append(t)
            words = {w: lens.tokenizer.convert_tokens_to_string(p).strip() for w, p in pieces.items()}
            for pos, w in enumerate(wids):
                if w is None:
                    left_out += 1
                    continue
                word = words[w]
                if word not in cache:
                    cache[word] = zipf(word, lang)
                if cache[word] <= 0:
                    left_out += 1
                    continue
                rows.append((index, pos, word, cache[word], *(q[k][b, :, pos] for k in QUANTITIES)))
            index += 1
        if on_batch:
            on_batch(len(enc.tokens))
    if not rows:
        raise MixlensError("no token has a known word frequency")
    base = pd.DataFrame([r[:4] for r in rows], columns=["input", "position", "word", "zipf"])
    for k, name in enumerate(QUANTITIES):
        vals = np.stack([r[4 + k] for r in rows])  # [tokens, L]
        for layer in range(n_layers):
            base[f"{name}_{layer}"] = vals[:, layer]
    rho = pd.DataFrame(
        [
            (layer, *(spearmanr(base["zipf"], base[f"{k}_{layer}"]).statistic for k in QUANTITIES))
            for layer in range(n_layers)
        ],
        columns=["layer", *(f"rho_{k}" for k in QUANTITIES)],
    )
    return FrequencyReport(base, rho, n_layers, left_out)


def frequency_figure(report: FrequencyReport, path: Path, title: str) -> None:
    """Left: ρ per layer for the three quantities; right: mean mixing ratio per Zipf-frequency bin per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = {
        "ratio": "ResLN-N mixing ratio r",
        "self": "own contribution ‖g(t_ii)‖",
        "context": "context contribution ‖Σ_{j≠i} g(t_ij)‖",
    }
    layers = report.rho["layer"].to_numpy()
    for k in QUANTITIES:
        a.plot(layers, report.rho[f"rho_{k}"], marker="o", label=labels[k])
    a.axhline(0, color="0.6", lw=0.8)
    a.set_xlabel("layer")
    a.set_ylabel("Spearman ρ with word frequency (Zipf)")
    a.set_xticks(layers)
    a.set_title("Frequency vs. mixing, per layer", fontsize=10)
    a.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    t = report.tokens
    edges = np.arange(np.floor(t["zipf"].min()), np.ceil(t["zipf"].max()) + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    bins = np.digitize(t["zipf"], edges[1:-1])
    cmap = plt.get_cmap("viridis")
    for layer in range(report.n_layers):
        means = [
            t[f"ratio_{layer}"][bins == k].mean() if (bins == k).sum() >= 20 else np.nan for k in range(len(centres))
        ]
        b.plot(centres, means, marker=".", color=cmap(layer / max(1, report.n_layers - 1)), label=f"layer {layer}")
    b.set_xlabel("word frequency (Zipf bin centre; bins with ≥ 20 tokens)")
    b.set_ylabel("mean ResLN-N mixing ratio")
    b.set_title("Mixing ratio by frequency bin", fontsize=10)
    b.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
