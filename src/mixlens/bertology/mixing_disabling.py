"""Does context mixing explain what disabling attention costs? (issue #16, item 5)

Per layer: the mean ResLN-N context-mixing ratio over the real tokens of the task's texts, beside the
metric change from disabling that layer's attention (`uniform` and `zero`, the sweep of
`mixlens.interventions`). Per head: the head's share of the attention output norm,
mean over real tokens i of ‖z^h_i W_O^h‖ / Σ_h' ‖z^h'_i W_O^h'‖ (z^h_i = Σ_j α^h_ij v^h_j), beside the change from
disabling that head alone. Reported: Spearman ρ between the mixing quantity and the harm (the metric change
signed so that positive = worse) over layers and over heads (NaN where either side is constant).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mixlens.errors import MixlensError
from mixlens.trace import Trace

if TYPE_CHECKING:
    from mixlens.bertology.sweep import SweepResult


def _traces(lens, texts: Sequence, batch_size: int, max_length: int | None) -> Iterator[Trace]:
    """One trace per batch, up to the last attention block (what the norm engine reads)."""
    for batch in lens.batches(list(texts), batch_size, max_length, trace=["norm"]):
        yield batch.trace


@torch.no_grad()
def mixing_profile(
    lens, texts: Sequence, batch_size: int = 32, max_length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(mean ResLN-N ratio per layer [L], mean share of each head in the attention output norm [L, H])."""
    from mixlens.interventions import head_contexts
    from mixlens.methods.engine import block_norms

    if not texts:
        raise MixlensError("no input text given")
    ratio_sum = share_sum = torch.zeros((), dtype=torch.float64)  # → [L] and [L, H]
    count = 0
    for tr in _traces(lens, texts, batch_size, max_length):
        m = tr.mask.float()  # [B, n]
        ratio_sum = ratio_sum + (block_norms(tr).ratio["ResLN-N"] * m[:, None]).sum((0, 2)).double()
        z = head_contexts(tr).float()  # [B, L, H, n, d_h]
        norms = torch.stack(
            [
                torch.einsum("bhnk,hkd->bhnd", z[:, layer], lay.w_o.float().reshape(lay.n_heads, lay.d_head, -1)).norm(
                    dim=-1
                )
                for layer, lay in enumerate(lens.adapter.layers)
            ],
            1,
        )
        share = norms / norms.sum(2, keepdim=True).clamp_min(torch.finfo(norms.dtype).tiny)  # [B, L, H, n]
        share_sum = share_sum + (share * m[:, None, None]).sum((0, 3)).double()
        count += int(tr.mask.sum())
    return (ratio_sum / count).numpy(), (share_sum / count).numpy()


@dataclass
class MixingDisablingReport:
    """Mixing quantities, harms per mode ({mode: [L]} and {mode: [L, H]}; positive = worse) and the
    Spearman ρ of each mode over layers and over heads."""

    ratio: np.ndarray
    share: np.ndarray
    layer_harm: dict[str, np.ndarray]
    head_harm: dict[str, np.ndarray]
    rho_layers: dict[str, float]
    rho_heads: dict[str, float]
    baseline: float
    metric: str


def mixing_vs_disabling(
    lens,
    task,
    texts: Sequence,
    modes: Sequence[str] = ("uniform", "zero"),
    batch_size: int = 32,
    on_step: Callable[[int], None] | None = None,
    done: Mapping[str, SweepResult] | None = None,
) -> MixingDisablingReport:
    """Run the sweep of every mode on `task` and relate it to the mixing profile of `texts`. `done`: sweeps
    already run on the same task ({mode: result}, e.g. `read_sweep_csv` of `mixlens sweep` outputs), used instead
    of running those modes again."""
    import warnings

    from scipy.stats import ConstantInputWarning, spearmanr

    from mixlens.bertology.sweep import sweep

    ratio, share = mixing_profile(lens, texts, batch_size)
    layer_harm, head_harm, rho_l, rho_h = {}, {}, {}, {}
    baseline = float("nan")
    for mode in modes:
        res = done[mode] if done and mode in done else sweep(lens, task, mode, on_step)
        sign = -1.0 if res.higher_is_better else 1.0
        layer_harm[mode], head_harm[mode] = sign * res.delta_layers, sign * res.delta_heads
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConstantInputWarning)
            rho_l[mode] = float(spearmanr(ratio, layer_harm[mode]).statistic)
            rho_h[mode] = float(spearmanr(share.ravel(), head_harm[mode].ravel()).statistic)
        baseline = res.baseline
    return MixingDisablingReport(ratio, share, layer_harm, head_harm, rho_l, rho_h, baseline, task.metric)


def mixing_disabling_figure(rep: MixingDisablingReport, path: Path, title: str) -> None:
    """Left: mixing ratio and layer-disabling harm per layer; right: head share vs single-head harm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    layers = np.arange(len(rep.ratio))
    a.bar(layers, 100 * rep.ratio, color="0.75", label="ResLN-N mixing ratio (%)")
    a.set_xlabel("layer")
    a.set_ylabel("mean ResLN-N mixing ratio (%)")
    a.set_xticks(layers)
    a2 = a.twinx()
    for mode, marker in zip(rep.layer_harm, "os", strict=False):
        a2.plot(layers, rep.layer_harm[mode], marker=marker, label=f"harm, {mode} (ρ = {rep.rho_layers[mode]:+.2f})")
    a2.set_ylabel(f"harm of disabling the layer ({rep.metric} drop)")
    a.set_title("Per layer", fontsize=10)
    h1, l1 = a.get_legend_handles_labels()
    h2, l2 = a2.get_legend_handles_labels()
    a.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.18), ncol=2)
    for mode, marker in zip(rep.head_harm, "os", strict=False):
        b.scatter(
            100 * rep.share.ravel(),
            rep.head_harm[mode].ravel(),
            s=14,
            marker=marker,
            alpha=0.7,
            label=f"{mode} (ρ = {rep.rho_heads[mode]:+.2f})",
        )
    b.axhline(0, color="0.6", lw=0.8)
    b.set_xlabel("head's share of the attention output norm (%)")
    b.set_ylabel(f"harm of disabling the head ({rep.metric} drop)")
    b.set_title("Per head", fontsize=10)
    b.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(w_pad=4)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
