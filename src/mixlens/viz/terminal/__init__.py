"""Terminal output (rich and plain text) of every result, in one place; the commands and the result objects' `show`
call these.

- `attribution`: `show_attribution` (`Attribution.show`: shaded token × token tables, per-token score bars);
- `explanation`: `show_explanation` (`Explanation.show`, `mixlens explain`: tokens with a score row per method);
- `analysis`: `print_results` (`mixlens analyze --format table`) and its parts;
- `evaluation`: `print_evaluation`, `print_evidence` / `evidence_table` (`mixlens evaluate`);
- `studies`: corpus runs, `compare-local-global`, `saliency`, `sweep`, `prune`, `ablate-patterns`;
- `tables`: `print_table` / `print_frame`, the width-fitting tables the others and the dataset commands print.
"""

from mixlens.viz.terminal.analysis import describe, print_ratios, print_results, print_scores, print_top_sources
from mixlens.viz.terminal.attribution import show_attribution
from mixlens.viz.terminal.evaluation import evidence_table, print_evaluation, print_evidence
from mixlens.viz.terminal.explanation import show_explanation
from mixlens.viz.terminal.studies import (
    print_agreement,
    print_corpus_summary,
    print_output_attribution,
    print_pattern_ablation,
    print_prune,
    print_sweep,
)
from mixlens.viz.terminal.tables import print_frame, print_table

__all__ = [
    "describe",
    "evidence_table",
    "print_agreement",
    "print_corpus_summary",
    "print_evaluation",
    "print_evidence",
    "print_frame",
    "print_output_attribution",
    "print_pattern_ablation",
    "print_prune",
    "print_ratios",
    "print_results",
    "print_scores",
    "print_sweep",
    "print_table",
    "print_top_sources",
    "show_attribution",
    "show_explanation",
]
