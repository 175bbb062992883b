"""BERTology studies: head statistics beyond the engine, head/layer disabling sweeps."""

from mixlens.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # `mixlens.bertology.<module>` imports on first use
