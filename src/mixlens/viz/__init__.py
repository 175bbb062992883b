"""Every view of results: self-contained HTML report (`html`), local viewer (`server`), static figures of the
report views (`static`) and figures of per-head results (`heads`)."""

from mixlens import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # `mixlens.viz.<module>` imports on first use
