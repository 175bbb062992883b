"""BERTology study commands: `relations`, `frequency`, `identify` (docs/guides/bertology.md §7–9)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import typer

from mixlens.commands.options import (
    NO_RUNTIME,
    Runtime,
    batch_size_option,
    check_wordfreq_lang,
    data_option,
    gguf_file_option,
    limit_option,
    model_option,
    option_block,
    runtime_options,
    text_column_option,
    writable_dir,
)
from mixlens.errors import MixlensError
from mixlens.viz.labels import model_label


def _texts_and_lens(inputs: SimpleNamespace, runtime: Runtime) -> tuple[list[str], Any]:
    """The texts of the data file of a `TEXT_STUDY` block, and the model they go through (loaded with `runtime`)."""
    from mixlens.commands.options import check_limit, read_examples

    examples = read_examples(inputs.data, inputs.text_column, None, check_limit(inputs.limit))
    if not examples:
        raise MixlensError(f"{inputs.data} holds no texts")
    return [ex.text for ex in examples], runtime.load(inputs.model, gguf_file=inputs.gguf_file, head="base")


def _write(
    out: Path, tables: dict[str, Any], figure: Callable[[Path], None], figure_name: str, frame: Any, title: str
) -> str:
    """Write the tables (name → DataFrame, as CSV) and the figure into `out`, print `frame` under `title`; → the
    files written, for the closing line."""
    from mixlens.result import atomic_write
    from mixlens.viz.terminal import print_frame

    for name, df in tables.items():
        atomic_write(out / name, df.to_csv(index=False).encode())
    figure(out / figure_name)
    print_frame(frame, title)
    names = [*tables, figure_name]
    return f"{out}/{', '.join(names[:-1])} and {names[-1]}"


TEXT_COL = text_column_option()
LIMIT = limit_option("Use only the first N records.")
BATCH = batch_size_option()
TEXT_STUDY = (  # the options of the studies over a file of texts (frequency, identify)
    ("data", str, data_option()),
    ("model", str | None, model_option()),
    ("gguf_file", str | None, gguf_file_option()),
    ("text_column", str | None, TEXT_COL),
    ("limit", int | None, LIMIT),
    ("batch_size", int, BATCH),
)


def register(app: typer.Typer) -> None:
    @app.command("relations")
    @runtime_options
    def relations_cmd(
        data: str | None = typer.Option(
            None,
            "--data",
            "-d",
            help="Relation JSONL file: one object per line, "
            '{"words": [...], "pairs": [{"from": i, "to": j, "relation": '
            '"nsubj"}]} (0-based word indices).',
        ),
        from_conllu: str | None = typer.Option(
            None, "--from-conllu", help="Build the pairs (dependent → head) from a CoNLL-U file instead of --data."
        ),
        relation: list[str] = typer.Option(
            None,
            "--relation",
            help="Relations taken from --from-conllu (repeatable; default nsubj, obj, amod, advmod).",
        ),
        save_pairs: Path | None = typer.Option(
            None, "--save-pairs", help="Also write the records read as relation JSONL."
        ),
        model: str | None = model_option(),
        gguf_file: str | None = gguf_file_option(),
        limit: int | None = LIMIT,
        batch_size: int = BATCH,
        permutations: int = typer.Option(1000, "--permutations", min=1, help="Permutations of the test."),
        seed: int = typer.Option(0, "--seed", help="Seed of the permutation test."),
        out: Path = typer.Option(
            Path("mixlens-relations"), "--out", "-o", help="Directory for table and figure.", callback=writable_dir
        ),
        runtime: Runtime = NO_RUNTIME,
    ) -> None:
        """Per head and relation: mean weight between related words vs. pairs at the same distance."""
        from mixlens.bertology.relations import (
            UD_RELATIONS,
            conllu_records,
            read_relations,
            relation_figure,
            relation_heads,
            write_relations,
        )
        from mixlens.commands.options import check_limit
        from mixlens.commands.output import check_writable, progress

        if (data is None) == (from_conllu is None):
            raise MixlensError("give exactly one of --data (relation JSONL) and --from-conllu")
        if data is not None:
            if relation:
                raise MixlensError("--relation selects relations of --from-conllu only")
            records = read_relations(data, check_limit(limit))
        else:
            assert from_conllu is not None  # exactly one of the two, checked above
            records = conllu_records(from_conllu, list(relation) if relation else UD_RELATIONS, check_limit(limit))
        if save_pairs is not None:
            check_writable(save_pairs)  # written only once the study succeeded, but refused before the work
        lens = runtime.load(model, gguf_file=gguf_file, head="base")
        with progress(len(records), "relations") as step:
            rep = relation_heads(
                lens, records, n_permutations=permutations, seed=seed, batch_size=batch_size, on_batch=step
            )
        title = (
            f"Best head per relation and view — {model_label(lens.name)}, {rep.n_records} records, "
            f"{permutations} permutations"
        )
        files = _write(
            out, {"relations.csv": rep.table}, lambda p: relation_figure(rep, p), "relations.png", rep.best(), title
        )
        if save_pairs is not None:
            write_relations(records, save_pairs)
            files = f"{files}; pairs in {save_pairs}"
        typer.echo(f"wrote {files} ({rep.skipped} pairs left out)", err=True)

    @app.command("frequency")
    @runtime_options
    @option_block(*TEXT_STUDY)
    def frequency_cmd(
        inputs: SimpleNamespace,
        lang: str = typer.Option("en", "--lang", help="wordfreq language code."),
        out: Path = typer.Option(
            Path("mixlens-frequency"), "--out", "-o", help="Directory for tables and figure.", callback=writable_dir
        ),
        runtime: Runtime = NO_RUNTIME,
    ) -> None:
        """Spearman ρ per layer between word frequency (wordfreq) and ResLN-N mixing / own / context norms."""
        from mixlens.bertology.frequency import frequency_figure, frequency_study
        from mixlens.commands.output import progress

        check_wordfreq_lang(lang)
        texts, lens = _texts_and_lens(inputs, runtime)
        with progress(len(texts), "frequency") as step:
            rep = frequency_study(lens, texts, lang=lang, batch_size=inputs.batch_size, on_batch=step)
        tables = {"frequency_rho.csv": rep.rho, "frequency_tokens.csv": rep.tokens}
        caption = f"{model_label(lens.name)}: {len(rep.tokens)} tokens of {len(texts)} inputs"
        title = (
            f"Spearman ρ with word frequency — {model_label(lens.name)}, {len(rep.tokens)} tokens "
            f"({rep.left_out} special or unknown left out)"
        )
        files = _write(out, tables, lambda p: frequency_figure(rep, p, caption), "frequency.png", rep.rho, title)
        typer.echo(f"wrote {files}", err=True)

    @app.command("identify")
    @runtime_options
    @option_block(*TEXT_STUDY)
    def identify_cmd(
        inputs: SimpleNamespace,
        train_share: float = typer.Option(0.5, "--train-share", help="Share of sentences the probes train on."),
        seed: int = typer.Option(0, "--seed", help="Seed of the split and the MLP."),
        probe: list[str] = typer.Option(None, "--probe", help="nn_cos, nn_l2, linear, mlp (repeatable; default all)."),
        mlp_epochs: int = typer.Option(5, "--mlp-epochs", min=1, help="Training epochs of the MLP probe."),
        out: Path = typer.Option(
            Path("mixlens-identify"), "--out", "-o", help="Directory for table and figure.", callback=writable_dir
        ),
        runtime: Runtime = NO_RUNTIME,
    ) -> None:
        """Share of tokens whose input token is recovered from each layer's hidden state (Brunner 2020)."""
        from mixlens.bertology.identifiability import PROBES, identifiability, identifiability_figure
        from mixlens.commands.output import progress

        texts, lens = _texts_and_lens(inputs, runtime)
        with progress(len(texts), "hidden states") as step:
            rep = identifiability(
                lens,
                texts,
                train_share=train_share,
                seed=seed,
                probes=list(probe) if probe else PROBES,
                mlp_epochs=mlp_epochs,
                batch_size=inputs.batch_size,
                on_step=step,
            )
        title = (
            f"Share of identified held-out tokens — {model_label(lens.name)}, {rep.n_test_tokens} tokens in "
            f"{rep.n_test_sentences} sentences (probes trained on {rep.n_train_sentences})"
        )
        caption = f"Token identifiability — {model_label(lens.name)}"
        files = _write(
            out,
            {"identify.csv": rep.table},
            lambda p: identifiability_figure(rep, p, caption),
            "identify.png",
            rep.table,
            title,
        )
        typer.echo(f"wrote {files}", err=True)
