"""The views of the result types, registered with `mixlens.result.views` (the results import no view)."""

from __future__ import annotations

from mixlens.result import views
from mixlens.viz import highlight, html
from mixlens.viz.terminal import show_attribution, show_explanation

views.register("attribution.show", show_attribution)
views.register("attribution.notebook", html.render_fragment)
views.register("analysis.notebook", html.render_fragment)
views.register("explanation.show", show_explanation)
views.register("explanation.page", highlight.render_page)
views.register("explanation.notebook", highlight.render_fragment)
