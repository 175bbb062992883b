"""Pruning heads that help (Michel et al. 2019): choose heads on a selection split, confirm on a held-out split.

1. One disabling sweep (`mixlens.bertology.sweep`, mode zero) on the selection split gives each head's gain g_h
   (the metric change when it alone is disabled, signed so that > 0 is better).
2. Greedy forward selection in the order of g_h: a head with g_h > `min_gain` joins the set when disabling the set
   plus it improves the selection score by more than `min_gain` over the set alone (one forward pass each).
3. The set is scored on the held-out split, which the selection never saw: the combined change and a paired
   bootstrap interval (seeded; resampling held-out examples; both models scored on the same resample).

Mode zero (z^h ← 0, b_O stays) is what removing the heads from the weights computes, so the chosen set can be
removed physically (`prune_model`: smaller q/k/v rows and output-projection columns, BERT-style layers) with the
same outputs (tested).

A saved checkpoint (`save_pruned`) keeps the tensor shapes its config declares, with the removed heads' q/k/v rows
and output-projection columns zero (transformers 5 has no per-layer head counts), so that `mixlens.load(dir)` and
plain `transformers` load it and compute the pruned model; `load_pruned(dir)` drops the zero heads again (the
smaller, faster model). The config lists the removed heads under `mixlens_pruned_heads`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mixlens.bertology.sweep import sweep
from mixlens.bertology.tasks import ClassificationTask, MlmTask, StsTask, Task
from mixlens.errors import MixlensError
from mixlens.interventions import Ablation, format_heads, merged_edits
from mixlens.trace import hooked

MIN_SPLIT = 10  # examples each split needs at least (a Spearman ρ or accuracy on fewer confirms nothing)
PRUNABLE = ("bert", "roberta", "electra")  # families whose attention reads the head count from the weights
CONFIG_KEY = "mixlens_pruned_heads"


def split_indices(n: int, held_out: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random split of n examples → (selection, held-out) index arrays, each sorted."""
    if not 0 < held_out < 1:
        raise MixlensError(f"--held-out must be a fraction between 0 and 1, got {held_out}")
    perm = np.random.default_rng(seed).permutation(n)
    k = int(round(n * held_out))
    if min(k, n - k) < MIN_SPLIT:
        raise MixlensError(
            f"{n} examples split {n - k}/{k} is too small to confirm a pruning; "
            f"each split needs at least {MIN_SPLIT} examples"
        )
    return np.sort(perm[k:]), np.sort(perm[:k])


def task_outputs(lens, task: Task, ablations: Sequence[Ablation] = ()) -> list[torch.Tensor]:
    """`task.collect` of every batch (one copy) with `ablations` disabled (any mode but mean)."""
    extra = {"use_cache": False} if lens.adapter.family.causal else {}
    parts = []
    with torch.no_grad():
        for i, inputs in enumerate(task.batches):
            edits = merged_edits(lens, ablations, inputs["attention_mask"].bool()) if ablations else {}
            with hooked(lens.adapter, edits):
                out = lens.model(**inputs, **extra)
            parts.append(task.collect(out, i))
    return parts


def _example_values(task: Task, parts: list[torch.Tensor]) -> np.ndarray:
    """Per-example values the metric is a function of: STS cosine [n], correctness [n], MLM (ce sum, count)
    [n, 2] (rows in the task's batch order; the same order for every model)."""
    if isinstance(task, StsTask):
        emb = torch.empty(len(task.order), parts[0].shape[-1])
        emb[torch.as_tensor(task.order)] = torch.cat(parts).float().cpu()
        return torch.nn.functional.cosine_similarity(emb[0::2], emb[1::2], dim=-1).numpy()
    if isinstance(task, (ClassificationTask, MlmTask)):
        return torch.cat(parts).float().cpu().numpy()
    raise MixlensError("the bootstrap interval supports the sts, accuracy and mlm tasks")


def _rank_rows(x: np.ndarray) -> np.ndarray:
    from scipy.stats import rankdata

    return rankdata(x, axis=1)


def _statistic(task: Task, values: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The task metric on each resample: idx [R, m] example indices → [R]."""
    if isinstance(task, StsTask):
        a, b = _rank_rows(values[idx]), _rank_rows(task.gold[idx])
        a, b = a - a.mean(1, keepdims=True), b - b.mean(1, keepdims=True)
        return (a * b).sum(1) / np.sqrt((a * a).sum(1) * (b * b).sum(1)).clip(1e-300)
    if isinstance(task, MlmTask):
        v = values[idx]
        return v[..., 0].sum(1) / v[..., 1].sum(1)
    return values[idx].mean(1)


MAX_RESAMPLES = 100_000  # bootstrap resamples (`prune --resamples`): the differences are kept for the quantiles
RESAMPLE_CELLS = 1 << 22  # resample × example indices drawn at a time (a single draw up to 4,194 examples at 1,000)


def paired_bootstrap(
    task: Task,
    base: list[torch.Tensor],
    new: list[torch.Tensor],
    n_resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile interval of metric(new) − metric(base) over `n_resamples` resamples of the examples (the same
    resample for both models)."""
    if not 1 <= n_resamples <= MAX_RESAMPLES:
        raise MixlensError(f"n_resamples must be an integer in [1, {MAX_RESAMPLES:,}], got {n_resamples}")
    vb, vn = _example_values(task, base), _example_values(task, new)
    rng = np.random.default_rng(seed)
    step = max(1, RESAMPLE_CELLS // len(vb))  # resamples drawn at a time: memory flat in n_resamples
    d = np.empty(n_resamples)
    for r0 in range(0, n_resamples, step):
        idx = rng.integers(0, len(vb), size=(min(step, n_resamples - r0), len(vb)))  # [R, m]
        d[r0 : r0 + len(idx)] = _statistic(task, vn, idx) - _statistic(task, vb, idx)
    lo, hi = np.quantile(d, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


@dataclass
class PruneResult:
    """The chosen heads (in order of choice) and their effect on both splits. Scores are the task metric;
    `*_gain` are signed so that > 0 is better (−Δ for losses)."""

    metric: str
    higher_is_better: bool
    heads: list[tuple[int, int]]
    head_gains: np.ndarray  # [L, H] single-head gain on the selection split
    selection_baseline: float
    selection_score: float
    heldout_baseline: float
    heldout_score: float
    ci: tuple[float, float]  # bootstrap interval of heldout_score − heldout_baseline
    n_selection: int
    n_heldout: int
    steps: list[tuple[str, float, bool]] = field(default_factory=list)  # (head, selection score with it, kept)

    @property
    def spec(self) -> str:
        """The head set as `--disable` takes it, e.g. `L5H8,L0H9`."""
        return format_heads(self.heads)

    @property
    def heldout_delta(self) -> float:
        return self.heldout_score - self.heldout_baseline

    @property
    def confirmed(self) -> bool:
        """Whether the whole bootstrap interval lies on the better side of 0."""
        lo, hi = self.ci
        return bool(self.heads) and (lo > 0 if self.higher_is_better else hi < 0)


def ablations_for(heads: Sequence[tuple[int, int]], mode: str = "zero") -> list[Ablation]:
    by: dict[int, list[int]] = {}
    for la, h in heads:
        by.setdefault(la, []).append(h)
    return [Ablation(la, tuple(sorted(hs)), mode) for la, hs in sorted(by.items())]


def prune(
    lens,
    selection: Task,
    heldout: Task,
    *,
    max_heads: int | None = None,
    min_gain: float = 0.0,
    n_resamples: int = 1000,
    seed: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> PruneResult:
    """Choose heads whose removal (mode zero) improves `selection`, and score the set on `heldout`."""
    if selection.metric != heldout.metric:
        raise MixlensError("the selection and held-out tasks must use the same metric")
    sign = 1.0 if selection.higher_is_better else -1.0
    res = sweep(lens, selection, "zero", on_step=on_step)
    gains = sign * res.delta_heads
    order = sorted(((la, h) for la, h in zip(*np.nonzero(gains > min_gain), strict=True)), key=lambda lh: -gains[lh])
    chosen: list[tuple[int, int]] = []
    current, steps = res.baseline, []
    for la, h in order:
        if max_heads is not None and len(chosen) >= max_heads:
            break
        trial = [*chosen, (int(la), int(h))]
        score = selection.score(task_outputs(lens, selection, ablations_for(trial)))
        keep = sign * (score - current) > min_gain
        steps.append((f"L{la}H{h}", score, keep))
        if keep:
            chosen, current = trial, score
        if on_step:
            on_step(1)
    base = task_outputs(lens, heldout)
    new = task_outputs(lens, heldout, ablations_for(chosen)) if chosen else base
    if chosen:
        ci = paired_bootstrap(heldout, base, new, n_resamples, seed)
    else:  # nothing removed: the difference is exactly 0, unless the metric itself is not a number
        ci = (0.0, 0.0) if np.isfinite(heldout.score(base)) else (float("nan"), float("nan"))
    return PruneResult(
        selection.metric,
        selection.higher_is_better,
        chosen,
        gains,
        res.baseline,
        current,
        heldout.score(base),
        heldout.score(new),
        ci,
        selection.n_examples,
        heldout.n_examples,
        steps,
    )


# --- physical removal ---------------------------------------------------------------------------------------


def _smaller(lin: nn.Linear, keep: torch.Tensor, dim: int) -> nn.Linear:
    """`lin` keeping rows (dim 0: output features) or columns (dim 1: input features) `keep`."""
    w = lin.weight.detach().index_select(dim, keep).clone()
    new = nn.Linear(w.shape[1], w.shape[0], bias=lin.bias is not None, dtype=w.dtype, device=w.device)
    new.weight.data.copy_(w)
    if lin.bias is not None:
        new.bias.data.copy_(lin.bias.detach() if dim == 1 else lin.bias.detach()[keep])
    return new


def _prunable(model: Any) -> Any:
    """The adapter of a model whose heads can be removed from the weights, or a `MixlensError`."""
    from mixlens.adapters import resolve

    adapter = resolve(model)
    if adapter.family.name not in PRUNABLE:
        raise MixlensError(
            f"physical pruning supports {', '.join(PRUNABLE)} models, not {adapter.family.name}; "
            "use --disable to disable the heads instead"
        )
    return adapter


def zero_heads(model: Any, heads: Mapping[int, Sequence[int]]) -> None:
    """Zero the q/k/v rows (weights and biases) and output-projection columns of `heads` in place: the shapes stay,
    the model computes what zero ablation (and `prune_model`) computes."""
    adapter = _prunable(model)
    with torch.no_grad():
        for layer, hs in heads.items():
            lay = adapter.layers[layer]
            attn, d_h = lay.attn, lay.d_head
            block: Any = lay.module
            for h in hs:
                rows = slice(h * d_h, (h + 1) * d_h)
                for name in ("query", "key", "value"):
                    lin = getattr(attn, name)
                    lin.weight[rows] = 0
                    if lin.bias is not None:
                        lin.bias[rows] = 0
                block.attention.output.dense.weight[:, rows] = 0


def prune_model(model: Any, heads: Mapping[int, Sequence[int]]) -> None:
    """Remove `heads` ({layer: [head, ...]}) from a BERT-style model in place: the q/k/v rows and output-projection
    columns of those heads go; b_O stays (so the model computes what zero ablation computes)."""
    adapter = _prunable(model)
    for layer, hs in heads.items():
        lay = adapter.layers[layer]
        attn, d_h, n = lay.attn, lay.d_head, lay.n_heads
        gone = set(hs)
        keep = torch.tensor([h * d_h + i for h in range(n) if h not in gone for i in range(d_h)], dtype=torch.long)
        for name in ("query", "key", "value"):
            setattr(attn, name, _smaller(getattr(attn, name), keep, 0))
        block: Any = lay.module  # BertLayer (and its RoBERTa/ELECTRA copies)
        out = block.attention.output
        out.dense = _smaller(out.dense, keep, 1)


def pruned_copies(lens, heads: Sequence[tuple[int, int]]) -> tuple[Any, Any]:
    """(a copy of the lens's model with `heads` zeroed — what `save_pruned` writes —, one with them removed)."""
    earlier = getattr(lens.model.config, CONFIG_KEY, None)  # a pruned checkpoint pruned again: keep its heads
    earlier = earlier if isinstance(earlier, dict) else {}
    by: dict[int, list[int]] = {int(k): list(v) for k, v in earlier.items()}
    for la, h in heads:
        if h not in by.setdefault(la, []):
            by[la].append(h)
    dense = copy.deepcopy(lens.model)
    zero_heads(dense, by)
    setattr(dense.config, CONFIG_KEY, {str(k): sorted(v) for k, v in by.items()})
    small = copy.deepcopy(dense)
    prune_model(small, by)
    return dense, small


def is_pruned_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a directory that `save_pruned` wrote (its config lists `mixlens_pruned_heads`)."""
    from mixlens import jsonio

    cfg = Path(path) / "config.json"
    try:
        return cfg.is_file() and CONFIG_KEY in jsonio.read(cfg)
    except MixlensError:
        return False


def check_save_target(path: str | Path, source: str | Path | None = None) -> None:
    """Refuse a `--save` target that would lose data or save nothing: the model's own folder `source`, a file, or a
    non-empty directory that is not an earlier pruned checkpoint (which is replaced)."""
    path = Path(path).expanduser()
    if source is not None and Path(source).expanduser().exists() and path.resolve() == Path(source).resolve():
        raise MixlensError(f"--save '{path}' is the --model folder: saving would overwrite the source checkpoint")
    if path.exists() and not path.is_dir():
        raise MixlensError(f"--save '{path}' is a file; give a directory for the pruned checkpoint")
    if path.is_dir() and any(path.iterdir()) and not is_pruned_checkpoint(path):
        raise MixlensError(
            f"--save '{path}' is a non-empty directory that holds no pruned checkpoint; give a new or empty directory"
        )
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise MixlensError(f"cannot write the pruned checkpoint to '{path}': '{probe}' is not a writable directory")


def write_checkpoint(model: Any, tokenizer: Any, path: str | Path) -> None:
    """`model` and `tokenizer` to the directory `path`, through a temporary folder beside it that is renamed into
    place (an earlier pruned checkpoint there is replaced only once the new one is complete). A failing filesystem
    (read-only, full) is a `MixlensError` and leaves `path` as it was."""
    from safetensors import SafetensorError

    path = Path(path).expanduser()
    check_save_target(path)
    tmp: Path | None = None
    old: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        elif path.is_dir():  # an earlier pruned checkpoint: moved aside, removed once the new one is in place
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old.", suffix=".tmp"))
            path.rename(old / "checkpoint")
        tmp.rename(path)
        tmp = None
    except (OSError, SafetensorError) as e:
        if old is not None and not path.exists():
            (old / "checkpoint").rename(path)  # put the earlier checkpoint back
        raise MixlensError(
            f"cannot save the pruned checkpoint to '{path}': {getattr(e, 'strerror', None) or e}"
        ) from None
    finally:
        for d in (tmp, old):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


def save_pruned(lens, heads: Sequence[tuple[int, int]], path: str | Path) -> Any:
    """Write a copy of the lens's model with `heads` zeroed (and its tokenizer) to `path` → the pruned model (the
    heads removed). `mixlens.load(path)` and transformers load the checkpoint as it is; `load_pruned(path)` removes
    the heads listed under `mixlens_pruned_heads` in its config again."""
    dense, small = pruned_copies(lens, heads)
    write_checkpoint(dense, lens.tokenizer, path)
    return small


def load_pruned(path: str | Path) -> Any:
    """A model saved by `save_pruned` with the removed heads dropped from its weights: built from its config, given
    its weights and pruned (a checkpoint of the earlier format, already pruned, is pruned first)."""
    import transformers
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise MixlensError(f"'{path}' is not a saved model directory (no config.json)")
    config = transformers.AutoConfig.from_pretrained(path)
    removed = json.loads(json.dumps(getattr(config, CONFIG_KEY, {}) or {}))
    cls = getattr(transformers, (config.architectures or ["AutoModel"])[0])
    model = (cls.from_config if cls is transformers.AutoModel else cls._from_config)(
        config, attn_implementation="eager"
    )
    heads = {int(k): v for k, v in removed.items()}
    state = load_file(path / "model.safetensors")
    own = model.state_dict()
    if all(own[k].shape == v.shape for k, v in state.items() if k in own):  # full shapes, the heads zero
        model.load_state_dict(state)
        prune_model(model, heads)
    else:
        prune_model(model, heads)
        model.load_state_dict(state)
    return model.eval()


def n_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def forward_seconds(model: nn.Module, inputs: dict[str, torch.Tensor], repeats: int = 5) -> float:
    """Median wall time of one forward pass over `inputs` (after one warm-up)."""
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            model(**inputs)
            times.append(time.perf_counter() - t)
    return float(np.median(times[1:]))
