"""CLI: `mixlens evaluate --task context` (which passage of a long context holds the answer; `explain.context`)."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import typer

from mixlens.commands.options import INVOCATION, Runtime
from mixlens.commands.options import interrupted as stopped
from mixlens.errors import MixlensError


def evaluate_context_cmd(
    data: Path,
    model: str | None,
    gguf_file: str | None,
    head: str | None,
    method: list[str] | None,
    skip: int,
    limit: int,
    seed: int,
    dest: Path,
    fmt: str,
    runtime: Runtime,
    leave_one_out: bool = True,
) -> None:
    """The context task's run into `dest` (held by the lock; an interrupted run there resumes), its
    evaluation.json and its table (or the JSON on stdout). `leave_one_out=False` (`--removal none`): without the
    leave-one-passage-out reference (its N + 1 forward passes)."""
    from mixlens.commands.output import progress, write_stdout
    from mixlens.explain import checkpoint
    from mixlens.explain import context as C

    prompts = C.read_prompts(data, skip, limit)  # a bad file fails before the model loads
    run: dict[str, object] = {"data": checkpoint.data_stamp(data), "skip": skip}
    if not leave_one_out:
        run["leave_one_out"] = False
    command = shlex.join(["mixlens", *INVOCATION])
    with checkpoint.locked(dest, command):
        saved = C.read_saved(dest / checkpoint.FILE)
        resume = None
        if saved is not None:
            ev, interrupted = saved
            if interrupted:
                resume = ev
            elif any(ev.run.get(k) != v for k, v in run.items()):
                raise MixlensError(
                    f"{dest / checkpoint.FILE} holds a finished evaluation of other data (or another --removal); "
                    "use another --out or delete it"
                )
        lens = runtime.load(model, gguf_file=gguf_file, head=head)
        try:
            with progress(len(prompts), "evaluate", done=float(len(resume.examples) if resume else 0)) as step:
                ev = C.evaluate_context(
                    lens,
                    prompts,
                    method or None,
                    seed=seed,
                    run=run,
                    with_loo=leave_one_out,
                    resume=resume,
                    checkpoint=lambda part: _write(dest, part, interrupted=True),
                    progress=step,
                    on_resume=lambda k: typer.echo(
                        f"resuming the interrupted evaluation in {dest} ({k} prompts done)", err=True
                    ),
                )
        except KeyboardInterrupt:
            raise stopped(f"the prompts finished so far are in {dest / checkpoint.FILE}") from None
        payload = _write(dest, ev, interrupted=False)
    if fmt == "json":
        write_stdout(payload + "\n")
    else:
        typer.echo(ev.table())
        for note in ev.notes:
            typer.echo(f"note: {note}")
    typer.echo(f"wrote {dest / checkpoint.FILE}", err=True)


def _write(dest: Path, ev, interrupted: bool) -> str:
    """evaluation.json into `dest` (an interrupted run's with its marker); a folder this call created is removed
    again when writing fails."""
    from mixlens.result import atomic_write

    payload = ev.dumps()
    if interrupted:
        doc = json.loads(payload)
        doc["interrupted"] = {"examples": len(ev.examples), "of": ev.total}
        payload = json.dumps(doc, allow_nan=False)
    created = not dest.exists()
    try:
        dest.mkdir(parents=True, exist_ok=True)
        atomic_write(dest / "evaluation.json", payload.encode())
    except OSError as e:
        if created:
            shutil.rmtree(dest, ignore_errors=True)
        raise MixlensError(f"cannot write to '{dest}': {e.strerror or e}") from None
    return payload
