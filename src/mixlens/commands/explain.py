"""CLI: `mixlens explain` (one score per token and method for a prediction) and `mixlens evaluate` (faithfulness)."""

from __future__ import annotations

import itertools
import json
import shlex
import shutil
import sys
from collections.abc import Iterable, Iterator, Sized
from pathlib import Path

import typer

from mixlens.commands.options import (
    INVOCATION,
    NO_RUNTIME,
    Runtime,
    deprecated_head_option,
    gguf_file_option,
    interrupted,
    model_head_option,
    model_option,
    pick_model_head,
    runtime_options,
    writable_dir,
    writable_file,
)
from mixlens.errors import MixlensError

FORMATS = ("table", "json", "html", "png")
DEFAULT_OUT = {"html": Path("mixlens-explain.html"), "png": Path("mixlens-explain.png")}


def register(app: typer.Typer) -> None:
    @app.command("explain")
    @runtime_options
    def explain_cmd(
        text: list[str] = typer.Argument(None, help="One or more texts (none with --chat)."),
        model: str | None = model_option(),
        gguf_file: str | None = gguf_file_option(),
        model_head: str | None = model_head_option(),
        head: str | None = deprecated_head_option(),
        method: list[str] = typer.Option(
            None,
            "--method",
            help="Method (repeatable); default: the methods recommended for the model's kind where the registry "
            "declares some (causal LMs: logit_attn and attnlrp, docs/findings/evaluate.md), else every applicable "
            "method but exact HTA; 'all': every applicable method but exact HTA.",
        ),
        target: str | None = typer.Option(
            None,
            "--target",
            help="Class index or label name (classifiers), or a token or phrase (causal LMs); default: the prediction.",
        ),
        foil: str | None = typer.Option(
            None, "--foil", help="Contrast token/class/phrase: explain score(target) − score(foil)."
        ),
        answer: str | None = typer.Option(
            None,
            "--answer",
            help="Causal LMs: explain every token of this answer after the text at once ([answer × context] per "
            "method, docs/reference/answers.md).",
        ),
        generate: int = typer.Option(
            0, "--generate", min=0, help="Causal LMs: generate N tokens greedily and explain them as the answer."
        ),
        fmt: str = typer.Option(
            "table", "--format", "-f", help="table (terminal), json, html or png (the segments' figure)."
        ),
        out: Path | None = typer.Option(
            None,
            "--out",
            "-o",
            help="Output file (json: default stdout; html: default mixlens-explain.html; png: mixlens-explain.png).",
            callback=writable_file,
        ),
        seed: int = typer.Option(0, "--seed", help="Seed of the sampling methods (gradient_shap, lime)."),
        chat: str | None = typer.Option(
            None,
            "--chat",
            help="A conversation (JSON list of role/content messages, or a file of one) rendered with the model's "
            "chat template and explained in place of TEXT; each message is a segment.",
        ),
        span: list[str] = typer.Option(
            None, "--span", help="A segment given as the character range START:END of each text (repeatable)."
        ),
        marker: list[str] = typer.Option(
            None, "--marker", help="Each occurrence of this string starts a segment (repeatable)."
        ),
        separator: str | None = typer.Option(None, "--separator", help="Segments: the passages between these."),
        runtime: Runtime = NO_RUNTIME,
    ) -> None:
        """Explain a prediction: each token's score for the target, per method; with segments (--chat, --span,
        --marker, --separator) also each segment's score (the sum of its tokens' scores): ranked in the table, in the
        JSON and the HTML page, and drawn with the answer × segments heatmap by --format png."""
        from mixlens.commands.output import check_writable, progress
        from mixlens.explain import explain
        from mixlens.result import atomic_write

        if fmt not in FORMATS:
            raise MixlensError(f"unknown format '{fmt}'; valid: {', '.join(FORMATS)}")
        if answer is not None and target is not None:
            raise MixlensError("--answer explains the answer's tokens; drop --target")
        if fmt == "png" and not (chat or span or marker or separator):
            raise MixlensError(
                "--format png draws the segments: give --chat, --span, --marker or --separator "
                "(a figure of token scores: mixlens plot)"
            )
        if fmt == "png" and out is not None and out.suffix.lower() != ".png":
            raise MixlensError(f"--format png writes a .png file, not '{out.name}'")
        if out is not None or fmt in DEFAULT_OUT:
            check_writable(out or DEFAULT_OUT[fmt])  # before any work
        messages = segment_request(text, chat, span, marker, separator, generate)
        lens = runtime.load(model, gguf_file=gguf_file, head=pick_model_head(model_head, head))
        if messages is not None:
            from mixlens.explain.segments import chat as chat_segments

            text = [chat_segments(lens.tokenizer, messages).text]
        warn_unspaced(lens, text[0], target, foil)
        chosen = chosen_methods(lens, method)
        with progress(len(text), "explain") as step:
            res = explain(
                lens,
                text,
                chosen,
                target=target,
                foil=foil,
                answer=answer,
                generate=generate,
                seed=seed,
                progress=step,
            )
        if messages is not None or span or marker or separator is not None:
            res.segments = segment_inputs(lens, res, messages, span, marker, separator)
        if fmt == "html":
            dest = out or DEFAULT_OUT[fmt]
            atomic_write(dest, res.html().encode())
            typer.echo(f"wrote {dest}", err=True)
        elif fmt == "png":
            from mixlens.viz.segments import segments_figure
            from mixlens.viz.static import save_figure

            dest = out or DEFAULT_OUT[fmt]
            save_figure(segments_figure(res), dest)
            typer.echo(f"wrote the segments figure to {dest}", err=True)
        elif fmt == "json":
            if out is None:
                sys.stdout.write(res.dumps() + "\n")
            else:
                atomic_write(out, res.dumps().encode())
                typer.echo(f"wrote {out}", err=True)
        else:
            res.show()  # with the segments, ranked, where given
            if out is not None:
                atomic_write(out, res.dumps().encode())
                typer.echo(f"wrote {out}", err=True)

    @app.command("evaluate")
    @runtime_options
    def evaluate_cmd(
        model: str | None = model_option(),
        gguf_file: str | None = gguf_file_option(),
        data: Path = typer.Option(
            ...,
            "--data",
            help="Dataset file (TSV/CSV/JSONL/Parquet/text), one input per record; --task blimp: a task CSV or a "
            "folder of them (one paradigm per file).",
        ),
        task: str = typer.Option(
            "faithfulness",
            "--task",
            help="faithfulness (remove top tokens; the model's prediction), blimp (causal LMs: each prompt's "
            "target vs foil word, alignment with the evidence words) or context (causal LMs: which passage of a "
            "long prompt holds the answer; a JSONL of scripts/context_task.py; docs/guides/explain-and-evaluate.md).",
        ),
        model_head: str | None = model_head_option(),
        head: str | None = deprecated_head_option(),
        text_column: str | None = typer.Option(None, "--text-column", help="Column with the text."),
        method: list[str] = typer.Option(
            None,
            "--method",
            help="Method (repeatable); default: every applicable "
            "method but exact HTA. A seeded 'random' baseline is always added.",
        ),
        skip: int = typer.Option(
            0, "--skip", min=0, help="Skip the first N records (e.g. the training part); blimp: per paradigm."
        ),
        limit: int = typer.Option(
            0, "--limit", min=0, help="Evaluate at most N records (0 = all); blimp: per paradigm."
        ),
        removal: str = typer.Option(
            "delete",
            "--removal",
            help="delete (drop the tokens), mask (mask token) or none (no perturbed passes: only the agreement "
            "and, --task blimp, the alignment with the evidence; several times faster; --task context: without the "
            "leave-one-passage-out reference).",
        ),
        fmt: str = typer.Option("table", "--format", "-f", help="table or json (json: evaluation.json on stdout)."),
        out: Path | None = typer.Option(
            None,
            "--out",
            "-o",
            help="Directory for evaluation.json and evaluation.png (default: mixlens-evaluation).",
            callback=writable_dir,
        ),
        batch_size: int = typer.Option(8, "--batch-size", min=1),
        seed: int = typer.Option(0, "--seed", help="Seed of the random baseline, samplers and bootstrap."),
        runtime: Runtime = NO_RUNTIME,
    ) -> None:
        """Measure how faithful each explanation method is (comprehensiveness, sufficiency, AOPC, agreement).
        Ctrl-C keeps the finished examples in DIR/evaluation.json (saved there every minute too, so a killed run
        loses at most the last minute); the same command then resumes after them."""
        from mixlens.commands.output import check_writable
        from mixlens.explain import checkpoint, evidence
        from mixlens.explain.evaluate import REMOVALS

        if fmt not in ("table", "json"):
            raise MixlensError(f"unknown format '{fmt}'; valid: table, json")
        if removal not in REMOVALS:
            raise MixlensError(f"unknown removal '{removal}'; valid: {', '.join(REMOVALS)}")
        if task == "context":  # its own data, run and output (`commands.context`)
            if text_column is not None or removal == "mask":
                raise MixlensError(
                    "--task context reads its own JSONL fields and removes whole passages (leave-one-out) or nothing: "
                    "drop --text-column; --removal delete (the default) or none"
                )
            from mixlens.commands.context import evaluate_context_cmd

            dest = out or Path("mixlens-evaluation")
            check_writable(dest, directory=True)
            evaluate_context_cmd(
                data,
                model,
                gguf_file,
                pick_model_head(model_head, head),
                method,
                skip,
                limit,
                seed,
                dest,
                fmt,
                runtime,
                leave_one_out=removal == "delete",
            )
            return
        if task not in evidence.TASKS:
            raise MixlensError(f"unknown task '{task}'; valid: {', '.join(evidence.TASKS)}, context")
        if task != "faithfulness" and text_column is not None:
            raise MixlensError(f"--task {task} reads its own columns (one_prefix_prefix, ...); drop --text-column")
        if task == "faithfulness":
            data_file(data)
        elif not data.exists():
            raise MixlensError(f"data '{data}' does not exist")
        dest = out or Path("mixlens-evaluation")
        check_writable(dest, directory=True)
        run = {"data": checkpoint.data_stamp(data), "task": task, "skip": skip, "text_column": text_column}
        with checkpoint.locked(dest, shlex.join(["mixlens", *INVOCATION])):  # one run at a time writes into dest
            saved = checkpoint.read_saved(dest / checkpoint.FILE)  # a damaged file fails before the model loads
            if saved is not None and "interrupted" not in saved:
                checkpoint.check_replace(saved, dest / checkpoint.FILE, run)
            model_head = pick_model_head(model_head, head)
            args = (model, gguf_file, model_head, text_column, method, skip, limit, removal, batch_size, seed)
            _evaluate_data(data, task, *args, dest, fmt, saved, run, runtime)


def _evaluate_data(
    data: Path,
    task: str,
    model: str | None,
    gguf_file: str | None,
    head: str | None,
    text_column: str | None,
    method: list[str] | None,
    skip: int,
    limit: int,
    removal: str,
    batch_size: int,
    seed: int,
    dest: Path,
    fmt: str,
    saved: dict | None,
    run: dict[str, object],
    runtime: Runtime,
) -> None:
    """`evaluate`'s work once its folder is held: the data read, the model loaded, the run and its files."""
    from mixlens.batching import has_visible
    from mixlens.corpus.readers import iter_examples
    from mixlens.explain import evidence

    skipped: list[str] = []
    if task != "faithfulness":
        rows = evidence.check_rows(data, skip, limit)  # a bad file fails before the model loads (read, not kept)
        lens = runtime.load(model, gguf_file=gguf_file, head=head)
        left_out: dict[str, dict[str, int]] = {}  # filled as the rows stream through the tokenizer, in chunks
        pairs = evidence.stream(lens.tokenizer, evidence.iter_rows(data, skip, limit), lens.max_length, left_out)
        first = next(pairs, None)
        if first is None:
            raise MixlensError(f"no prompt of '{data}' is usable; {evidence.skip_line(left_out)}")
        a, b = itertools.tee(itertools.chain([first], pairs))  # drawn in step: tee holds one pair at most
        _evaluate_and_write(
            lens,
            (t for t, _ in a),
            method,
            removal,
            batch_size,
            seed,
            dest,
            skipped,
            fmt,
            saved,
            run,
            (c for _, c in b),
            task,
            left_out,
            rows,
        )
        return

    def dropped(kind: str, where: str) -> None:
        skipped.append(f"{where} ({kind})")
        typer.echo(f"warning: {data}: {where}; record skipped", err=True)

    def texts(on_skip=None) -> Iterator[str]:
        """The file's texts, read record by record as they are asked for (never the file whole)."""
        examples = iter_examples(data, text_column=text_column, on_skip=on_skip)
        for k, ex in enumerate(itertools.islice(examples, skip, skip + limit if limit else None), 1):
            if not isinstance(ex.text, str):
                raise MixlensError("evaluate takes single texts, not sentence pairs")
            if not has_visible(ex.text):
                raise MixlensError(f"input {k} is empty or whitespace only")
            yield ex.text

    total = sum(1 for _ in texts())  # read once without keeping them: a bad file fails before the model loads
    if not total:
        raise MixlensError(f"no examples to evaluate in '{data}'" + (f" after skipping {skip}" if skip else ""))
    lens = runtime.load(model, gguf_file=gguf_file, head=head)
    stream = texts(dropped)  # read again as the batches ask for them: memory stays flat in the file's size
    _evaluate_and_write(lens, stream, method, removal, batch_size, seed, dest, skipped, fmt, saved, run, total=total)


def _evaluate_and_write(
    lens,
    texts: Iterable[str],
    method: list[str] | None,
    removal: str,
    batch_size: int,
    seed: int,
    dest: Path,
    skipped: list[str],
    fmt: str,
    saved: dict | None,
    run: dict[str, object],
    contrasts=None,
    task: str = "faithfulness",
    left_out: dict[str, dict[str, int]] | None = None,
    total: int | None = None,
) -> None:
    """`evaluate`'s run (resuming the interrupted one `saved` in `dest`), its files and its table or JSON. `texts`
    (and `contrasts`) may stream: `total` is then their number at most (the task file's rows; for progress)."""
    from mixlens.commands.output import progress, write_stdout
    from mixlens.explain import checkpoint
    from mixlens.explain.evaluate import Evaluation, Interrupted, evaluate

    if removal == "mask" and lens.tokenizer.mask_token_id is None:
        raise MixlensError("--removal mask needs a model with a mask token; this tokenizer has none (use delete)")
    resume = None
    if saved is not None and "interrupted" in saved:
        resume = Evaluation.from_json(saved)  # checked field by field (`checkpoint.read_saved`)
    elif saved is not None:
        checkpoint.check_replace(saved, dest / checkpoint.FILE, run, model=lens.name)
    try:
        resumed = float(len(resume.examples)) if resume is not None else 0.0
        size = len(texts) if isinstance(texts, Sized) else total or 0
        with progress(size, "evaluate", done=resumed) as step:
            last = [resumed]

            def advance(done: float, _: int) -> None:
                done += sum(sum(r.values()) for r in (left_out or {}).values())  # rows left out count as read
                step(max(0.0, done - last[0]))
                last[0] = max(last[0], done)

            ev = evaluate(
                lens,
                texts,
                method or None,
                removal=removal,
                batch_size=batch_size,
                seed=seed,
                progress=advance,
                resume=resume,
                contrasts=contrasts,
                task=task,
                skipped=left_out,
                checkpoint=lambda part: _write(dest, part, skipped, interrupted=max(size, len(part.examples))),
                run=run,
                total=total,
                on_resume=lambda k: typer.echo(
                    f"resuming the interrupted evaluation in {dest} ({k} examples done)", err=True
                ),
            )
    except Interrupted as stop:
        part = stop.partial.get(removal)
        if part is None:
            typer.echo("mixlens: interrupted before the first batch finished; nothing was written", err=True)
        else:
            _write(dest, part, skipped, interrupted=stop.total)
            raise interrupted(
                f"kept {len(part.examples)} of {stop.total} examples in {dest / 'evaluation.json'}"
            ) from None
        raise typer.Exit(130) from None
    payload = _write(dest, ev, skipped)
    if fmt == "json":
        write_stdout(payload + "\n")
    elif task != "faithfulness":
        from mixlens.viz.terminal import print_evidence

        print_evidence(ev)
    else:
        from mixlens.viz.terminal import print_evaluation

        print_evaluation(ev)
    typer.echo(f"wrote {dest / 'evaluation.json'} and {dest / 'evaluation.png'}", err=True)


def chosen_methods(lens, given: list[str] | None) -> list[str] | None:
    """explain's methods: those given; `all`: every applicable one but the slow (None, explain's own default);
    none given: the ones the registry recommends for the model's kind (`Method.recommended`), saying on stderr which
    others exist, or explain's default where the kind has none recommended."""
    from mixlens.explain.attributions import default_methods
    from mixlens.explain.explain import explained_kind
    from mixlens.methods import get, registry

    if given:
        if "all" in given:
            if len(given) > 1:
                raise MixlensError("--method all runs every applicable method: give it alone")
            return None
        return list(given)
    kind = explained_kind(lens.model)
    family = lens.adapter.family
    picked = [m for m in registry.explainers(kind, defaults=True, recommended=True) if get(m).refusal(family) is None]
    if not picked:
        return None
    others = [m for m in default_methods(kind, family) if m not in picked]
    typer.echo(
        f"explaining with {', '.join(picked)}, the methods recommended for this kind of model "
        "(docs/findings/evaluate.md); "
        f"others: {', '.join(others)} (--method NAME, or --method all)",
        err=True,
    )
    return picked


def segment_request(
    text: list[str] | None,
    chat: str | None,
    span: list[str] | None,
    marker: list[str] | None,
    separator: str | None,
    generate: int,
) -> list[dict[str, str]] | None:
    """Check explain's texts and segment options before the model loads; the conversation of --chat, if given."""
    from mixlens.explain.segments import check_text, read_chat

    kinds = [k for k, v in (("--chat", chat), ("--span", span), ("--marker", marker), ("--separator", separator)) if v]
    if len(kinds) > 1:
        raise MixlensError(f"give one kind of segments, not {' and '.join(kinds)}")
    if chat is not None:
        if text:
            raise MixlensError("--chat explains the conversation: give no TEXT")
        return read_chat(chat)
    if not text:
        raise MixlensError("give one or more texts (or --chat)")
    ranges = []
    for s in span or []:
        start, _, end = s.partition(":")
        if not (start.strip().isdigit() and end.strip().isdigit()):
            raise MixlensError(f"--span '{s}' must be START:END character positions, e.g. 0:120")
        ranges.append((int(start), int(end)))
    for k, t in enumerate(text, 1):
        try:
            check_text(t, ranges, marker, separator)
        except MixlensError as e:
            raise MixlensError(f"text {k}: {e}" if len(text) > 1 else str(e)) from None
    return None


def segment_inputs(lens, res, messages, span, marker, separator) -> list:
    """Each explained input's segments (`Segment`s over the tokens it was explained with), for `res.segments`."""
    from mixlens.explain import segments as S

    found = []
    for b, ex in enumerate(res.inputs):
        if messages is not None:
            seg = S.chat(lens.tokenizer, messages)
            labelled = [(s.label, s.char_start, s.char_end) for s in seg.segments]
            seg = S.segmentation(lens.tokenizer, seg.text, labelled)  # tokenized as explain tokenized it
        elif span:
            cuts = [s.split(":") for s in span]
            seg = S.spans(lens.tokenizer, ex.text, [(int(a), int(b)) for a, b in cuts])
        elif marker:
            seg = S.markers(lens.tokenizer, ex.text, marker)
        else:
            seg = S.passages(lens.tokenizer, ex.text, separator)
        answer = getattr(ex, "answer", None)  # an explained answer: the segments are of its prompt's tokens
        n = len(ex.tokens) if answer is None else int(answer["start"])
        fits = len(seg.input_ids) == n if answer is None else all(s.end <= n for s in seg.segments)
        if not fits:
            raise MixlensError(
                f"input {b + 1} was explained over {n} tokens (truncated?), its segments cover {len(seg.input_ids)}"
            )
        found.append(seg.segments)
    return found


SPACE_ODDS = 10.0  # the spaced form this many times likelier than the word as typed: warn


def warn_unspaced(lens, text: str, target: str | None, foil: str | None) -> None:
    """A causal LM's `--target are` (no leading space) where ' are' is one token too and the model finds it far
    likelier at the first input's next position: said on stderr (a word inside a sentence starts with a space)."""
    import torch

    from mixlens.targets import model_kind

    if model_kind(lens.model) != "causal":
        return
    tok = lens.tokenizer
    for what, spec in (("--target", target), ("--foil", foil)):
        if spec is None or not spec.strip() or spec[0].isspace() or spec.isdigit():
            continue
        ids = tok(spec, add_special_tokens=False)["input_ids"]
        spaced = tok(" " + spec, add_special_tokens=False)["input_ids"]
        if len(ids) != 1 or len(spaced) != 1 or ids == spaced:
            continue
        enc = tok(text, return_tensors="pt", truncation=True, max_length=lens.max_length)
        from mixlens.methods.saliency import keeps_logits

        last = {"logits_to_keep": 1} if keeps_logits(lens.model) else {}  # the last position only, not [n, vocabulary]
        with torch.no_grad():
            logits = lens.model(**{k: v.to(lens.device) for k, v in enc.items()}, **last).logits[0, -1]
        p = logits.float().softmax(-1)
        p_word, p_spaced = float(p[ids[0]]), float(p[spaced[0]])
        if p_spaced > SPACE_ODDS * p_word:
            typer.echo(
                f"warning: {what} '{spec}' has no leading space; the model gives '{spec}' p = {p_word:.2g} and "
                f"' {spec}' p = {p_spaced:.2g} after input 1: for the word, pass {what} ' {spec}'",
                err=True,
            )


def data_file(data: Path) -> None:
    """Refuse a `--data` that is not a readable file, saying what it is instead."""
    if data.is_dir():
        raise MixlensError(f"data file '{data}' is a directory; give a file (TSV/CSV/JSONL/Parquet/text)")
    if not data.exists():
        raise MixlensError(f"data file '{data}' does not exist")
    if not data.is_file():
        raise MixlensError(f"data file '{data}' is not a regular file")


def _write(dest: Path, ev, skipped: list[str], interrupted: int | None = None) -> str:
    """evaluation.json (with the skipped records and, for an interrupted run, how far it got) and evaluation.png
    into `dest`; a folder this call created is removed again when writing fails (a full disk leaves nothing)."""

    from mixlens.result import atomic_write
    from mixlens.viz.evaluation import plot

    if skipped:
        ev.notes.append(
            f"skipped {len(skipped)} unreadable records of the data file: "
            + "; ".join(skipped[:20])
            + (f" and {len(skipped) - 20} more" if len(skipped) > 20 else "")
        )
    payload = ev.dumps()
    if interrupted is not None:
        doc = json.loads(payload)
        doc["interrupted"] = {"examples": len(ev.examples), "of": interrupted}
        payload = json.dumps(doc, allow_nan=False)
    created = not dest.exists()
    try:
        try:
            dest.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MixlensError(f"cannot write to '{dest}': {e.strerror or e}") from None
        atomic_write(dest / "evaluation.json", payload.encode())
        if interrupted is None:
            plot(ev, dest / "evaluation.png")
    except BaseException:
        if created:
            shutil.rmtree(dest, ignore_errors=True)
        raise
    return payload
