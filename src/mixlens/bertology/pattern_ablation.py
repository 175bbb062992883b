"""Ablation by pattern type (Kovaleva et al. 2019, §5): disable every head of one Kovaleva type at once and compare
the metric change with disabling the same number of random heads.

A head's type is its most frequent label from `mixlens.stats.patterns.classify_inputs` over the inputs (ties go to
the earlier type in `PATTERNS`). The random control draws, per type, as many heads uniformly from all heads
(seeded, `draws` draws) and reports the mean ± sd of the change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mixlens.bertology.prune import ablations_for, task_outputs
from mixlens.bertology.tasks import Task
from mixlens.errors import MixlensError
from mixlens.stats.patterns import PATTERNS

MODES = ("uniform", "zero")


def head_types(labels: np.ndarray) -> np.ndarray:
    """Most frequent pattern type per head: labels [inputs, L, H] of str → [L, H] of str."""
    counts = np.stack([(labels == p).sum(0) for p in PATTERNS], -1)  # [L, H, types]
    return np.array(PATTERNS, dtype=object)[counts.argmax(-1)]


@dataclass
class PatternAblation:
    """Per pattern type: its heads disabled together vs as many random heads. `delta` = ablated − baseline."""

    metric: str
    higher_is_better: bool
    mode: str
    baseline: float
    types: np.ndarray  # [L, H] type of each head
    n_heads: dict[str, int]
    score: dict[str, float]  # metric with every head of the type disabled
    random_mean: dict[str, float]  # mean delta of `draws` random head sets of the same size
    random_sd: dict[str, float]
    draws: int

    def rows(self) -> list[tuple[str, int, float, float, float, float]]:
        """(type, heads, score, delta, random mean delta, random sd) for every type with heads."""
        return [
            (t, self.n_heads[t], self.score[t], self.score[t] - self.baseline, self.random_mean[t], self.random_sd[t])
            for t in PATTERNS
            if self.n_heads[t]
        ]


def ablate_patterns(
    lens,
    task: Task,
    types: np.ndarray,
    mode: str = "uniform",
    draws: int = 5,
    seed: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> PatternAblation:
    """Disable all heads of each type in `types` ([L, H], from `head_types`) at once; same-size random controls."""
    if mode not in MODES:
        raise MixlensError(f"unknown ablation mode '{mode}' for pattern ablation; valid: {', '.join(MODES)}")
    if draws < 2:
        raise MixlensError("--draws must be at least 2 (the random control reports a standard deviation)")
    n_layers, n_heads = types.shape
    if (n_layers, n_heads) != (lens.adapter.n_layers, lens.adapter.n_heads):
        raise MixlensError(f"head types of shape {types.shape} do not fit the model ({n_layers} × {n_heads})")
    all_heads = [(la, h) for la in range(n_layers) for h in range(n_heads)]

    def run(heads: list[tuple[int, int]]) -> float:
        s = task.score(task_outputs(lens, task, ablations_for(heads, mode)))
        if on_step:
            on_step(1)
        return s

    baseline = run([])
    rng = np.random.default_rng(seed)
    counts, score, r_mean, r_sd = {}, {}, {}, {}
    for t in PATTERNS:
        heads = [(la, h) for la, h in all_heads if types[la, h] == t]
        counts[t] = len(heads)
        if not heads:
            score[t], r_mean[t], r_sd[t] = float("nan"), float("nan"), float("nan")
            continue
        score[t] = run(heads)
        rand = [
            run([all_heads[i] for i in rng.choice(len(all_heads), len(heads), replace=False)]) - baseline
            for _ in range(draws)
        ]
        r_mean[t], r_sd[t] = float(np.mean(rand)), float(np.std(rand, ddof=1))
    return PatternAblation(
        task.metric, task.higher_is_better, mode, baseline, types, counts, score, r_mean, r_sd, draws
    )


def pattern_ablation_steps(types: np.ndarray, draws: int) -> int:
    """Forward passes over the task data `ablate_patterns` makes (for progress bars)."""
    return 1 + sum((1 + draws) for t in PATTERNS if (types == t).any())
