"""Head/layer disabling sweep (Michel et al. 2019; Kovaleva et al. 2019): score every single head and every
whole layer of a model, disabled with one of the modes of `mixlens.interventions`, on a task metric.

Per batch the model runs once to record the residual stream entering each layer; then, per layer l, ONE forward
pass runs layers ≥ l only (the engine's `start`/`resid_pre` options), fed the recorded stream, over H + 1
stacked copies of the batch: copy k disables head k, the last copy the whole layer. A task (`mixlens.bertology.
tasks`) owns the batches and the metric.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mixlens.bertology.tasks import Task
from mixlens.errors import MixlensError
from mixlens.interventions import MODES, edits_for, head_contexts
from mixlens.trace import Trace, hooked, run_traced

HIGHER_IS_BETTER = {"spearman": True, "accuracy": True, "mlm_loss": False}  # the metrics of mixlens.bertology.tasks


def _context_sums(trace: Trace) -> tuple[torch.Tensor, int]:
    """Sum of the head contexts over the real tokens [L, H, d_h], and the number of real tokens."""
    m = trace.mask[:, None, None, :, None].float()
    return (head_contexts(trace).float() * m).sum((0, 3)), int(trace.mask.sum())


@torch.no_grad()
def head_means(lens, texts: Sequence, batch_size: int = 32, max_length: int | None = None) -> torch.Tensor:
    """Mean head context over the real tokens of `texts` (the reference for mode 'mean'): [L, H, d_h]."""
    if not len(texts):
        raise MixlensError("no input text given")
    total, count = torch.zeros(()), 0
    for batch in lens.batches(list(texts), batch_size, max_length, trace=True):
        s, c = _context_sums(batch.trace)
        total, count = total + s, count + c
    return total / count


def _repeat(inputs: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    return {key: v.repeat(k, *([1] * (v.dim() - 1))) for key, v in inputs.items()}


@dataclass
class SweepResult:
    """Task scores: `baseline` unablated, `heads` [L, H] with one head disabled, `layers` [L] with one whole
    layer disabled. `delta_*` = ablated − baseline."""

    metric: str
    higher_is_better: bool
    mode: str
    baseline: float
    heads: np.ndarray
    layers: np.ndarray
    n_examples: int

    @property
    def delta_heads(self) -> np.ndarray:
        return self.heads - self.baseline

    @property
    def delta_layers(self) -> np.ndarray:
        return self.layers - self.baseline

    def top_changes(self, k: int = 10) -> list[tuple[str, float]]:
        """The k ablations that hurt the metric most (by signed harm), as ('L{l}H{h}' or 'L{l}', delta)."""
        sign = -1.0 if self.higher_is_better else 1.0
        items = [
            (f"L{la}H{h}", float(self.delta_heads[la, h]))
            for la in range(self.heads.shape[0])
            for h in range(self.heads.shape[1])
        ]
        items += [(f"L{la}", float(d)) for la, d in enumerate(self.delta_layers)]
        return sorted(items, key=lambda it: -sign * it[1])[:k]


@torch.no_grad()
def sweep(lens, task: Task, mode: str = "uniform", on_step: Callable[[int], None] | None = None) -> SweepResult:
    """Score every single head and every whole layer of `lens` disabled with `mode` on `task`.

    `task` is a `Task` (mixlens.bertology.tasks): `StsTask`, `MlmTask`, `ClassificationTask`, or your own
    subclass (see `Task` for what it must provide). `on_step(n)` is called after each forward pass
    (1 + L per batch, plus one per batch for mode 'mean').
    """
    if mode not in MODES:
        raise MixlensError(f"unknown ablation mode '{mode}'; valid: {', '.join(MODES)}")
    adapter = lens.adapter
    n_layers, n_heads = adapter.n_layers, adapter.n_heads
    groups: list[tuple[int, ...] | None] = [(h,) for h in range(n_heads)] + [None]
    k = len(groups)
    extra = {"use_cache": False} if adapter.family.causal else {}
    base_parts: list[torch.Tensor] = []
    means: torch.Tensor | None = None
    if mode == "mean":  # the reference contexts come from the same data, before any ablation
        total, count = torch.zeros(()), 0
        for inputs in task.batches:
            s, c = _context_sums(run_traced(adapter, lens.model, inputs))
            total, count = total + s, count + c
            if on_step:
                on_step(1)
        means = total / count
    parts: list[list[list[torch.Tensor]]] = [[[] for _ in range(k)] for _ in range(n_layers)]
    for i, inputs in enumerate(task.batches):
        b = inputs["input_ids"].shape[0]
        with hooked(adapter) as rec:
            out = lens.model(**inputs, **extra)
        base_parts.append(task.collect(out, i))
        if on_step:
            on_step(1)
        mask = inputs["attention_mask"].bool()
        stacked = _repeat(inputs, k)
        for layer in range(n_layers):
            edits = edits_for(lens, layer, groups, mode, mask, means)
            with hooked(adapter, edits, start=layer, resid_pre=rec["x"][layer].repeat(k, 1, 1)):
                out = lens.model(**stacked, **extra)
            res = task.collect(out, i)
            for c in range(k):
                parts[layer][c].append(res[c * b : (c + 1) * b])
            if on_step:
                on_step(1)
    baseline = task.score(base_parts)
    scores = np.array([[task.score(parts[layer][c]) for c in range(k)] for layer in range(n_layers)])
    return SweepResult(
        task.metric, task.higher_is_better, mode, baseline, scores[:, :n_heads], scores[:, n_heads], task.n_examples
    )


def read_sweep_csv(path: str | Path, mode: str, n_examples: int) -> SweepResult:
    """A `sweep.csv` written by `mixlens sweep` (layer, head or 'all', score, delta) back as a `SweepResult`, to
    relate a finished sweep to other measures without running it again (`mode` and `n_examples` as it was run)."""
    import pandas as pd

    df = pd.read_csv(path, dtype={"head": str})
    metric = str(df.columns[2])
    if list(df.columns) != ["layer", "head", metric, "delta"] or metric not in HIGHER_IS_BETTER:
        raise MixlensError(f"{path} is not a sweep.csv of `mixlens sweep` (columns {', '.join(df.columns)})")
    whole = df["head"] == "all"
    heads = df[~whole].astype({"head": int}).pivot(index="layer", columns="head", values=metric).to_numpy()
    layers = df[whole].sort_values("layer")[metric].to_numpy()
    baseline = float((df[metric] - df["delta"]).median())  # every row stores score and score − baseline
    return SweepResult(metric, HIGHER_IS_BETTER[metric], mode, baseline, heads, layers, n_examples)


def sweep_steps(lens, task: Task, mode: str) -> int:
    """Forward passes `sweep` will make (for progress bars)."""
    n = len(task.batches)
    return n * (1 + lens.adapter.n_layers) + (n if mode == "mean" else 0)
