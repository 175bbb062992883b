"""The `mixlens` command line (typer + rich). Every user error is one line on stderr and exit code 2.

Each command family is a module in `COMMAND_MODULES` exposing `register(app: typer.Typer) -> None`. Those
modules import only typer and the standard library at module level (heavy imports live in the command
bodies), so `mixlens --help` and `mixlens CMD --help` start without torch.
"""

from __future__ import annotations

import functools
import importlib
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from typer._click import exceptions as tx  # typer vendors click

from mixlens.errors import MixlensError, ReconstructionError
from mixlens.memory import out_of_memory

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Show how a Transformer mixes information between tokens.",
)

COMMAND_MODULES: list[str] = [
    "mixlens.commands.analyze",
    "mixlens.commands.corpus",
    "mixlens.commands.report",
    "mixlens.commands.heads",
    "mixlens.commands.syntax",
    "mixlens.commands.patterns",
    "mixlens.commands.sweep",
    "mixlens.commands.prune",
    "mixlens.commands.gradients",
    "mixlens.commands.studies",
    "mixlens.commands.explain",
    "mixlens.commands.families",
]


def _print_version(value: bool) -> None:
    if value:
        from mixlens import __version__

        typer.echo(f"mixlens {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Show how a Transformer mixes information between tokens."""


for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(app)


def quieted(callback: Callable[..., Any]) -> Callable[..., Any]:
    """`callback` that first silences library chatter — only when a command runs, not for `--help` — and answers
    Ctrl-C (or SIGTERM, `terminate_as_interrupt`) with one line saying what was kept."""

    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        from mixlens.commands.options import quiet_libraries

        quiet_libraries()
        try:
            with terminate_as_interrupt():
                return callback(*args, **kwargs)
        except KeyboardInterrupt:  # typer would turn it into a silent exit 130: say what was kept
            print(f"mixlens: interrupted; {interrupted_note()}", file=sys.stderr)
            raise typer.Exit(130) from None

    return run


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (`kill`, a job scheduler stopping the job) handled as Ctrl-C while a command runs: the command stops
    the same way and keeps what it finished (a resumable run resumes from it). Also the way to stop a job started in
    the background by a script, whose Ctrl-C (SIGINT) is ignored. Main thread only; the previous handler returns."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted_note() -> str:
    """What a command stopped by Ctrl-C kept: the files it had completed, or that nothing was written (every file
    is written whole, by a rename, or not at all)."""
    written = getattr(sys.modules.get("mixlens.atomic"), "WRITTEN", [])  # not imported: nothing was written
    if not written:
        return "nothing was written (results are written only when the command finishes)"
    done = list(dict.fromkeys(str(p) for p in written))
    return f"kept {', '.join(done)} (complete); nothing else was written"


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning user errors into one line and exit code 2."""
    cmd = typer.main.get_command(app)
    for sub in getattr(cmd, "commands", {}).values():
        if sub.callback is not None:
            sub.callback = quieted(sub.callback)
    from mixlens.commands import options

    args = list(sys.argv[1:] if argv is None else argv)
    options.INVOCATION[:] = args
    if "mixlens.atomic" in sys.modules:  # in-process calls (tests, notebooks): count only this command's files
        sys.modules["mixlens.atomic"].WRITTEN.clear()
    shown = warnings.showwarning
    warnings.showwarning = one_line_warning  # a library's warning (numpy, scipy, transformers): one line, no source
    try:
        options.check_argv(args)
        rc = cmd.main(args=args, prog_name="mixlens", standalone_mode=False)
    except typer.Exit as e:
        rc = e.exit_code
    except typer.Abort:
        print("mixlens: aborted", file=sys.stderr)
        rc = 130
    except tx.ClickException as e:
        print(f"mixlens: error: {e.format_message()}", file=sys.stderr)
        rc = 2
    except (MixlensError, ReconstructionError) as e:
        print(f"mixlens: error: {e}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        print(f"mixlens: interrupted; {interrupted_note()}", file=sys.stderr)
        rc = 130
    except (MemoryError, RuntimeError) as e:  # an allocation failure: one line, not a traceback
        line = out_of_memory(e)
        if line is None:
            raise
        print(f"mixlens: error: {line}", file=sys.stderr)
        rc = 2
    finally:
        warnings.showwarning = shown
    sys.exit(rc if isinstance(rc, int) else 0)


def one_line_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """How the CLI shows a warning: `mixlens: warning: MESSAGE` on stderr, one line, without the source path and line
    that Python's default format adds (they point into numpy's or scipy's code, not at anything the user did)."""
    text = " ".join(str(message).split())
    print(f"mixlens: warning: {text} ({category.__name__})", file=sys.stderr if file is None else file)
