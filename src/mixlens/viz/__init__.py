"""Every view of results: self-contained HTML report (`html`), local viewer (`server`), static figures of the
report views (`static`), figures of per-head results (`heads`) and every terminal view (`terminal`)."""

from mixlens.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # `mixlens.viz.<module>` imports on first use
