"""One run at a time per output folder: the lock `mixlens corpus` and `mixlens evaluate` hold on their `--out`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from mixlens.errors import MixlensError


def _holder(fd: int) -> str:
    """The running holder's line (`pid N: command`). The holder writes it just after taking the lock, so a refusal
    that lands in between waits for it a moment (up to 2 s) rather than naming no one."""
    import time

    deadline = time.monotonic() + 2.0
    while True:
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        if holder or time.monotonic() > deadline:
            return holder or "unknown process"
        time.sleep(0.02)


@contextlib.contextmanager
def run_lock(out: Path, lock: str, command: str, what: str, written: Callable[[], bool]) -> Iterator[None]:
    """Hold an exclusive lock (flock on `out/lock`) for the whole run: a second run into the same folder is refused
    with one line naming the running one (its pid and `command`; `what` names the kind of run). When the run ends
    without having written its result (`written()` is false), the lock file, the empty folders under `out` and the
    folders this run created are removed again: nothing is left behind."""
    import fcntl  # POSIX only: imported where used

    made: list[Path] = []
    for p in [out, *out.parents]:
        if p.exists() or p.is_symlink():
            break
        made.append(p)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise MixlensError(f"cannot write to '{out}': {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
            raise MixlensError(
                f"{out} is in use by another mixlens {what} run ({holder}); wait for it to finish or use another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {command}".encode(), 0)
        try:
            yield
        finally:
            if not written():  # nothing written: no lock file, no empty folder, no folder this run made
                (out / lock).unlink(missing_ok=True)
                for p in [*(q for q in out.iterdir() if q.is_dir()), *made]:
                    with contextlib.suppress(OSError):
                        p.rmdir()
    finally:
        os.close(fd)  # releases the lock
