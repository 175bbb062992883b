"""The package version (a leaf module: anything may import it)."""

__version__ = "0.8.1"
