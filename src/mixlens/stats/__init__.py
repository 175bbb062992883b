"""Statistics over attribution maps (token-type mass, entropy, head types, syntax, agreement)."""

from mixlens.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # `mixlens.stats.<module>` imports on first use
