"""Views of results: self-contained HTML report (`html`), static matplotlib figures (`static`), local viewer
(`server`)."""
