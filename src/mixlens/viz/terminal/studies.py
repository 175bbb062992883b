"""The terminal output of the study commands: a corpus run's mixing ratios, attention vs head attribution
(`compare-local-global`), output attributions (`saliency`), head sweeps, pruning and pattern ablation."""

from __future__ import annotations

from typing import Any

from mixlens.viz.labels import token_text
from mixlens.viz.terminal.tables import print_table


def print_corpus_summary(res: Any) -> None:
    """The mean mixing ratio per layer and method of a corpus run, as a table on stderr that fits the terminal."""
    from mixlens.methods.engine import RATIO_VARIANTS  # W, N, Res-W, Res-N, ResLN-N

    agg = res.aggregate()
    r = agg[agg["stat"] == "mixing_ratio"].pivot(index="layer", columns="method", values="mean")
    known = [v for v in RATIO_VARIANTS if v in r.columns]
    r = r[known + sorted(c for c in r.columns if c not in known)]  # the paper's order, not the alphabet
    rows = [[str(layer), *(f"{100 * x:.1f}" for x in row)] for layer, row in r.iterrows()]
    title = f"Mean context-mixing ratio (%) over all tokens — {res.manifest['model']}"
    print_table(title, ["layer", *map(str, r.columns)], rows, stderr=True)


def print_agreement(res: Any) -> None:
    """Per-layer agreement of attention and head attribution (a `LocalGlobal`) as a rich table, then the
    persistent token-type patterns."""
    from mixlens.stats.tokens import TOKEN_TYPES

    columns = ["layer", "JS", "Pearson", "Spearman", *[f"{t} loc/glob" for t in TOKEN_TYPES]]
    rows = []
    for layer in range(res.scores["js"].shape[0]):
        masses = [f"{res.local[t][layer].mean():.2f}/{res.global_[t][layer].mean():.2f}" for t in TOKEN_TYPES]
        rows.append(
            [str(layer), *(f"{res.scores[k][layer].mean():.3f}" for k in ("js", "pearson", "spearman")), *masses]
        )
    print_table(
        f"Attention (local) vs head attribution (global), {res.n_inputs} inputs, mean over heads", columns, rows
    )
    pers = res.persistent_patterns()
    print(
        f"patterns dominating a head in at least half the layers - attention: {', '.join(pers['local']) or 'none'};"
        f" head attribution: {', '.join(pers['global']) or 'none'}; both: {', '.join(pers['both']) or 'none'}"
    )


def print_output_attribution(tokens: list[list[str]], res: Any) -> None:
    """Per input of `saliency`: the target's value f(x) (and, for integrated gradients, f(baseline) and the
    convergence delta), then each token with its score."""
    for b, toks in enumerate(tokens):
        line = f"input {b + 1}: f(x) = {res.target_value[b]:.4f}"
        if res.delta is not None and res.baseline_value is not None:
            line += f", f(baseline) = {res.baseline_value[b]:.4f}, convergence delta = {res.delta[b]:.2e}"
        print(line)
        print("  " + "  ".join(f"{token_text(t)}:{v:.3g}" for t, v in zip(toks, res.values[b].tolist(), strict=False)))


def print_sweep(res: Any, what: str) -> None:
    """A head sweep: the baseline (`what`: which heads were disabled before) and the ten largest harms."""
    print(f"baseline {res.metric} ({what}, {res.n_examples} examples): {res.baseline:.4f}")
    print("largest harms (ablated − baseline):")
    for name, d in res.top_changes(10):
        print(f"  {name:8s} {d:+.4f}")


def print_prune(res: Any, resamples: int) -> None:
    """Greedy pruning: the metric before → after on the selection and the held-out split (with the bootstrap
    interval of the held-out change), the heads removed and the `--disable` spec that removes them."""
    lo, hi = res.ci
    print(
        f"selection split ({res.n_selection} examples): {res.metric} {res.selection_baseline:.4f} → "
        f"{res.selection_score:.4f}"
    )
    print(
        f"held-out split ({res.n_heldout} examples): {res.metric} {res.heldout_baseline:.4f} → "
        f"{res.heldout_score:.4f} (Δ {res.heldout_delta:+.4f}, 95% bootstrap interval [{lo:+.4f}, {hi:+.4f}], "
        f"{resamples} resamples)"
    )
    print(f"{len(res.heads)} heads removed; {'confirmed' if res.confirmed else 'not confirmed'} on held-out data")
    print(f"--disable {res.spec}" if res.heads else "no head helps")


def print_pattern_ablation(res: Any, n_examples: int, table: Any) -> None:
    """Pattern-type ablation: the baseline, then `table` (a DataFrame: per pattern type the heads, the metric, its
    change and the random-heads control) with signed numbers."""
    print(f"baseline {res.metric} (no ablation, {n_examples} examples): {res.baseline:.4f}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:+.4f}"))
