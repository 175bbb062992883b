"""`mixlens evaluate`'s terminal output: the faithfulness table (`print_evaluation`) and the evidence-alignment
tables of `--task blimp` (`print_evidence`), each followed by the notes of evaluation.json."""

from __future__ import annotations

import json
import math
import shutil
import textwrap
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mixlens.explain.evaluate import Evaluation


def print_evaluation(ev: Any) -> None:
    """`evaluate`'s faithfulness table (methods ranked by AOPC, each mean over its 95 % interval, the seconds per
    method), the time split and the notes of evaluation.json."""
    from rich.console import Console
    from rich.table import Table

    met = ev.metrics()
    by = "AOPC" if ev.removal != "none" else "ρ G×I"
    table = Table(title=f"Faithfulness ({ev.removal}), {len(ev.examples)} examples — {ev.model}; ranked by {by}")
    for col in ("method", "AOPC", "compreh.", "suffic. ↓", "ρ G×I", "s"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for m in ev.ranking():
        r = met[m]

        def cell(k: str, r=r) -> str:
            lo, hi = r["ci95"][k]
            if not math.isfinite(r[k]):  # not computed (removal none) or undefined
                return "-"
            return f"{r[k]:.3f}\n[{lo:.2f}, {hi:.2f}]"  # two lines: the table fits 100 columns

        table.add_row(
            m,
            cell("aopc"),
            cell("comprehensiveness"),
            cell("sufficiency"),
            cell("spearman_gxi"),
            f"{ev.timings.get(m, 0.0):.1f}",
        )
    Console(width=min(120, max(80, shutil.get_terminal_size((100, 24)).columns))).print(table)
    t = ev.timings
    print(
        f"time: total {t['total']:.1f} s, attributions {t['attributions']:.1f} s, perturbed forward passes "
        f"{t['forward']:.1f} s, evaluation's own {t['own']:.1f} s ({100 * t['own'] / t['total']:.1f} %)"
    )
    for note in json.loads(ev.dumps())["notes"]:  # as in evaluation.json, with undefined (null) metrics named
        print(f"note: {note}")


SHORT = {  # paradigm → table column (≤ 6 characters)
    "anaphor_gender_agreement": "anaGen",
    "anaphor_number_agreement": "anaNum",
    "animate_subject_passive": "animSP",
    "determiner_noun_agreement_1": "dna",
    "determiner_noun_agreement_irregular_1": "dnaIrr",
    "determiner_noun_agreement_with_adjective_1": "dnaAdj",
    "determiner_noun_agreement_with_adj_irregular_1": "dnaAI",
    "distractor_agreement_relational_noun": "distr",
    "ioi_dataset": "ioi",
    "irregular_plural_subject_verb_agreement_1": "svaIrr",
    "npi_present_1": "npi",
    "regular_plural_subject_verb_agreement_1": "svaReg",
}


def _short(group: str) -> str:
    return SHORT.get(group, group[:6])


def _num(v: object) -> str:
    x = float(v)  # type: ignore[arg-type]
    return "  -  " if not math.isfinite(x) else f"{x:.2f}"


def evidence_table(ev: Evaluation, width: int = 100) -> str:
    """Plain-text tables (≤ `width` columns): per paradigm n, skipped and accuracy; per method the pooled MRR with
    its interval, MRR on correct / wrong predictions and the logit-difference AOPC / comprehensiveness /
    sufficiency; then MRR per method and paradigm (paradigms in columns, as many as fit, the rest below)."""
    from mixlens.explain.evidence import ALL, task_metrics

    met: dict[str, Any] = task_metrics(ev)
    groups = [g for g in met if g != ALL]
    model = ev.model if len(ev.model) <= 50 else "…" + ev.model[-49:]
    lines = [f"Evidence alignment ({ev.task}, {ev.removal}) — {model}; {met[ALL]['n']} prompts", ""]
    lines.append(f"{'paradigm':<47} {'code':<6} {'n':>5} {'skip':>5} {'accuracy':>18}")
    for g in [*groups, ALL]:
        r = met[g]
        lo, hi = r["accuracy_ci95"]
        skip = sum(r["skipped"].values())
        lines.append(
            f"{g[:47]:<47} {(_short(g) if g != ALL else ''):<6} {r['n']:>5} {skip:>5} "
            f"{_num(r['accuracy'])} [{_num(lo)}, {_num(hi)}]"
        )
    lines += ["", "All paradigms pooled; MRR (higher: aligned); ΔAOPC etc. on the logit difference:"]
    lines.append(
        f"{'method':<22} {'MRR':>5} {'95% interval':^13} {'MRR✓':>6} {'MRR✗':>6} {'AOPC':>7} {'compr':>7} {'suff↓':>7}"
    )
    pooled = met[ALL]
    order = sorted(ev.methods, key=lambda m: -np.nan_to_num(pooled["all"][m]["mrr"], nan=-np.inf))
    for m in order:
        a = pooled["all"][m]
        lo, hi = a["ci95"]["mrr"]
        right, wrong = pooled["correct"][m]["mrr"], pooled["wrong"][m]["mrr"]
        lines.append(
            f"{m[:22]:<22} {_num(a['mrr']):>5} [{_num(lo)}, {_num(hi)}] {_num(right):>6} {_num(wrong):>6} "
            f"{_num(a['aopc']):>7} {_num(a['comprehensiveness']):>7} {_num(a['sufficiency']):>7}"
        )
    per_row = max(1, (width - 23) // 7)
    for start in range(0, len(groups), per_row):
        cols = groups[start : start + per_row]
        lines += ["", f"{'MRR per paradigm':<22} " + " ".join(f"{_short(g):>6}" for g in cols)]
        for m in order:
            lines.append(f"{m[:22]:<22} " + " ".join(f"{_num(met[g]['all'][m]['mrr']):>6}" for g in cols))
    return "\n".join(lines)


def print_evidence(ev: Evaluation) -> None:
    """`evaluate --task blimp`'s tables (`evidence_table`) and the notes of evaluation.json, wrapped to 100
    columns."""
    print(evidence_table(ev))
    for note in json.loads(ev.dumps())["notes"]:  # wrapped: the output fits 100 columns
        print(textwrap.fill(f"note: {note}", 100, subsequent_indent="  ", break_on_hyphens=False))
