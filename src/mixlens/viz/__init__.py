"""Every view of results: self-contained HTML report (`html`), local viewer (`server`), static figures of the
report views (`static`) and figures of per-head results (`heads`)."""
