"""Peak resident memory of this process, for the benchmarks and the fresh processes they spawn (which put this
folder on `sys.path` and import it)."""

from __future__ import annotations

from pathlib import Path

HERE = str(Path(__file__).resolve().parent)  # this folder, for a spawned process's sys.path


def peak_gib() -> float:
    """Peak RSS of this process in GiB: VmHWM, not ru_maxrss (on Linux a spawned child's ru_maxrss starts at its
    parent's peak)."""
    with Path("/proc/self/status").open() as fh:
        return int(next(x for x in fh if x.startswith("VmHWM")).split()[1]) / 2**20
