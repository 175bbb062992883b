"""BERTology study commands: `relations`, `frequency`, `identify` (docs/bertology.md §7–9)."""

from __future__ import annotations

from pathlib import Path

import typer

from mixlens.commands.options import (
    batch_size_option,
    check_wordfreq_lang,
    data_option,
    gguf_file_option,
    limit_option,
    model_option,
    text_column_option,
)
from mixlens.errors import MixlensError


def _texts(data: str, text_column: str | None, limit: int | None) -> list[str]:
    from mixlens.commands.options import check_limit, read_examples

    examples = read_examples(data, text_column, None, check_limit(limit))
    if not examples:
        raise MixlensError(f"{data} holds no texts")
    return [ex.text for ex in examples]


TEXT_COL = text_column_option()
LIMIT = limit_option("Use only the first N records.")
BATCH = batch_size_option()


def register(app: typer.Typer) -> None:
    @app.command("relations")
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
        out: Path = typer.Option(Path("mixlens-relations"), "--out", "-o", help="Directory for table and figure."),
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
        from mixlens.commands.output import print_frame, progress
        from mixlens.lens import load
        from mixlens.result import atomic_write

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
            write_relations(records, save_pairs)
        lens = load(model, gguf_file=gguf_file)
        with progress(len(records), "relations") as step:
            rep = relation_heads(
                lens, records, n_permutations=permutations, seed=seed, batch_size=batch_size, on_batch=step
            )
        atomic_write(out / "relations.csv", rep.table.to_csv(index=False).encode())
        relation_figure(rep, out / "relations.png")
        print_frame(
            rep.best(),
            f"Best head per relation and view — {lens.name}, {rep.n_records} records, {permutations} permutations",
        )
        typer.echo(f"wrote {out}/relations.csv and relations.png ({rep.skipped} pairs left out)", err=True)

    @app.command("frequency")
    def frequency_cmd(
        data: str = data_option(),
        model: str | None = model_option(),
        gguf_file: str | None = gguf_file_option(),
        text_column: str | None = TEXT_COL,
        limit: int | None = LIMIT,
        batch_size: int = BATCH,
        lang: str = typer.Option("en", "--lang", help="wordfreq language code."),
        out: Path = typer.Option(Path("mixlens-frequency"), "--out", "-o", help="Directory for tables and figure."),
    ) -> None:
        """Spearman ρ per layer between word frequency (wordfreq) and ResLN-N mixing / own / context norms."""
        from mixlens.bertology.frequency import frequency_figure, frequency_study
        from mixlens.commands.output import print_frame, progress
        from mixlens.lens import load
        from mixlens.result import atomic_write

        check_wordfreq_lang(lang)
        texts = _texts(data, text_column, limit)
        lens = load(model, gguf_file=gguf_file)
        with progress(len(texts), "frequency") as step:
            rep = frequency_study(lens, texts, lang=lang, batch_size=batch_size, on_batch=step)
        atomic_write(out / "frequency_rho.csv", rep.rho.to_csv(index=False).encode())
        atomic_write(out / "frequency_tokens.csv", rep.tokens.to_csv(index=False).encode())
        frequency_figure(rep, out / "frequency.png", f"{lens.name}: {len(rep.tokens)} tokens of {len(texts)} inputs")
        print_frame(
            rep.rho,
            f"Spearman ρ with word frequency — {lens.name}, {len(rep.tokens)} tokens "
            f"({rep.left_out} special or unknown left out)",
        )
        typer.echo(f"wrote {out}/frequency_rho.csv, frequency_tokens.csv and frequency.png", err=True)

    @app.command("identify")
    def identify_cmd(
        data: str = data_option(),
        model: str | None = model_option(),
        gguf_file: str | None = gguf_file_option(),
        text_column: str | None = TEXT_COL,
        limit: int | None = LIMIT,
        batch_size: int = BATCH,
        train_share: float = typer.Option(0.5, "--train-share", help="Share of sentences the probes train on."),
        seed: int = typer.Option(0, "--seed", help="Seed of the split and the MLP."),
        probe: list[str] = typer.Option(None, "--probe", help="nn_cos, nn_l2, linear, mlp (repeatable; default all)."),
        mlp_epochs: int = typer.Option(5, "--mlp-epochs", min=1, help="Training epochs of the MLP probe."),
        out: Path = typer.Option(Path("mixlens-identify"), "--out", "-o", help="Directory for table and figure."),
    ) -> None:
        """Share of tokens whose input token is recovered from each layer's hidden state (Brunner 2020)."""
        from mixlens.bertology.identifiability import PROBES, identifiability, identifiability_figure
        from mixlens.commands.output import print_frame, progress
        from mixlens.lens import load
        from mixlens.result import atomic_write

        texts = _texts(data, text_column, limit)
        lens = load(model, gguf_file=gguf_file)
        with progress(len(texts), "hidden states") as step:
            rep = identifiability(
                lens,
                texts,
                train_share=train_share,
                seed=seed,
                probes=list(probe) if probe else PROBES,
                mlp_epochs=mlp_epochs,
                batch_size=batch_size,
                on_step=step,
            )
        atomic_write(out / "identify.csv", rep.table.to_csv(index=False).encode())
        identifiability_figure(rep, out / "identify.png", f"Token identifiability — {lens.name}")
        print_frame(
            rep.table,
            f"Share of identified held-out tokens — {lens.name}, {rep.n_test_tokens} tokens in "
            f"{rep.n_test_sentences} sentences (probes trained on {rep.n_train_sentences})",
        )
        typer.echo(f"wrote {out}/identify.csv and identify.png", err=True)
