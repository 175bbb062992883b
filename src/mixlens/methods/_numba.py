"""numba, set up before mixlens compiles anything: full-width vectors on AVX-512 CPUs.

LLVM tunes Intel's AVX-512 cores (Skylake-SP through Sapphire Rapids and Granite Rapids) with `prefer-256-bit`, so
the loops numba vectorises there use 256-bit registers, half the width torch's BLAS uses for the forward pass on the
same cores (AMD's Zen 4 has no such tuning and gets 512-bit code already). Unless the user set `NUMBA_CPU_FEATURES`
(numba's own control, which is then left alone), the host's features plus `-prefer-256-bit` become numba's target
features. numba creates its code generator once per process, at the first compiled function: where another library
compiled one before mixlens was imported, this setting does not apply. Every numba module of mixlens imports `njit`
from here.
"""

from __future__ import annotations

from typing import Any

import llvmlite.binding as ll
from numba import njit
from numba.core import config

__all__ = ["njit", "target_features"]


def target_features(host: dict[str, bool], user: str | None) -> str | None:
    """numba's target features: `user` (NUMBA_CPU_FEATURES) when set, else for an AVX-512 `host` its features with
    `-prefer-256-bit`, else None (numba's default: the host's)."""
    if user is not None or not host.get("avx512f"):
        return user
    return ",".join([*(("+" if on else "-") + name for name, on in sorted(host.items())), "-prefer-256-bit"])


def _host_features() -> dict[str, bool]:
    try:
        return dict(ll.get_host_cpu_features())
    except RuntimeError:  # LLVM cannot read this host's features: numba's defaults
        return {}


_config: Any = config  # numba sets its options as module attributes when it reads the environment
if _config.ENABLE_AVX:  # NUMBA_ENABLE_AVX=0 asks numba for no AVX at all
    _config.CPU_FEATURES = target_features(_host_features(), _config.CPU_FEATURES)
