"""`atomic_write`, every command's way of writing a file (a leaf module: no torch, so a Ray Data read task may use
it)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mixlens.errors import MixlensError

WRITTEN: list[Path] = []  # files `atomic_write` completed in this process (the CLI's Ctrl-C line names them)


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write to a temp file beside `path`, fsync and close it, then rename: a crash never leaves a half file. A
    directory, device node, FIFO or socket at `path` (the rename would replace it) or a failing filesystem
    (read-only, full, no permission; a failed write, fsync or close) is a `MixlensError` naming the path, and the
    temp file is removed."""
    path = Path(path)
    if path.is_dir():
        raise MixlensError(f"cannot write '{path}': it is a directory; give a file name")
    if path.exists() and not path.is_file():  # the rename would replace a device node, FIFO or socket
        raise MixlensError(f"cannot write '{path}': it is not a regular file (a device, FIFO or socket)")
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:  # write, flush and fsync: a full disk fails here, not silently later
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        Path(tmp).chmod(0o666 & ~umask)  # mkstemp creates 0600; give the file the user's usual mode
        Path(tmp).replace(path)  # atomic (os.replace): a reader sees the old file or the new one, never a part
        WRITTEN.append(path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise MixlensError(f"cannot write '{path}': {e.strerror or e}") from None
        raise
