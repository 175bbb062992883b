"""`mixlens report` (self-contained HTML), `mixlens plot` (static figures) and `mixlens serve` (local viewer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from mixlens import catalog
from mixlens.commands.options import (
    NO_RUNTIME,
    Runtime,
    allow_random_head_option,
    check_methods,
    gguf_file_option,
    max_length_option,
    method_list_option,
    method_options_option,
    model_head_option,
    model_option,
    parse_options,
    precheck_model,
    runtime_options,
    writable_file,
)
from mixlens.commands.output import check_writable, method_progress
from mixlens.errors import MixlensError

if TYPE_CHECKING:  # the commands keep torch (and so the results and the lens) out of module level: start-up speed
    from mixlens.protocol import LensLike
    from mixlens.result import Analysis, Attribution


class View(str, Enum):
    heatmap = "heatmap"
    ratio = "ratio"
    bipartite = "bipartite"
    routes = "routes"
    logit_layers = "logit-layers"
    segments = "segments"


MAX_PANELS = 4
PLOT_METHOD = catalog.defaults("plot")[0]  # plot's default --method (heatmap, bipartite), from the registry


def from_option() -> Any:
    return typer.Option(
        None,
        "--from",
        help="Render a saved analysis (Analysis.save) or the JSON of `mixlens "
        "analyze` instead of TEXT; no model is loaded.",
    )


def read_saved(path: Path, text: list[str] | None, methods: list[str] | None) -> Any:
    """The analysis in `path` (`--from`), restricted to `methods` when given; TEXT may not be given too."""
    from mixlens.result import Analysis

    if text:
        raise MixlensError("give TEXT or --from FILE, not both")
    res = Analysis.load(path)
    if methods:
        res.attributions = {m: res[m] for m in methods}
    return res


def _logit_layers(
    text: list[str] | None,
    out: Path,
    model: str | None,
    gguf_file: str | None,
    method: str,
    model_head: str | None,
    from_file: Path | None,
    runtime: Runtime,
) -> None:
    """`plot --view logit-layers`: ALTI-Logit's per-layer view of a saved explanation (`explain -f json -o F`, or
    `Explanation.save`), or of TEXT explained here with alti_logit (or --method logit_attn)."""
    from mixlens.viz import static
    from mixlens.viz.logit_layers import layered, layered_methods, logit_layers_figure

    if out.suffix.lower().lstrip(".") not in static.FORMATS:
        raise MixlensError(f"--out must end in .png, .svg or .pdf, not '{out.name}'")
    drawn = layered_methods()
    if method not in (*drawn, PLOT_METHOD):
        raise MixlensError(f"--view logit-layers draws {' or '.join(drawn)}, not '{method}'")
    chosen = method if method in drawn else None
    if from_file is not None:
        res = read_saved(from_file, text, None)
        if getattr(res, "explained", None) is None:
            raise MixlensError(f"{from_file} is no explanation (write one with mixlens explain --method alti_logit)")
        held = [m for m in drawn if any(m in layered(e) for e in res.inputs)]
        if chosen is None and len(held) > 1:
            raise MixlensError(f"{from_file} holds per-layer rows of {' and '.join(held)}: choose one with --method")
        if chosen is None and held:
            chosen = held[0]
            typer.echo(f"drawing {chosen}, the method of {from_file} with per-layer rows", err=True)
    else:
        from mixlens.explain import explain

        if not text:
            raise MixlensError("give one or more texts, or --from FILE")
        lens = runtime.load(model, gguf_file=gguf_file, head=model_head or "causal-lm")
        res = explain(lens, text, [chosen or catalog.defaults("logit-layers")[0]])
    if len(res.texts) > MAX_PANELS:
        raise MixlensError(f"{len(res.texts)} inputs: a logit-layers figure holds at most {MAX_PANELS} panels")
    static.save_figure(logit_layers_figure(res, list(range(len(res.texts))), chosen), out)
    typer.echo(f"wrote the per-layer logit figure to {out}", err=True)


def _segments(text: list[str] | None, out: Path, from_file: Path | None) -> None:
    """`plot --view segments`: the ranked segments and the answer tokens × segments heatmap of a saved explanation
    with segments (`explain --chat/--span/--marker/--separator -f json -o F`)."""
    from mixlens.viz import static
    from mixlens.viz.segments import segments_figure

    if out.suffix.lower().lstrip(".") not in static.FORMATS:
        raise MixlensError(f"--out must end in .png, .svg or .pdf, not '{out.name}'")
    if from_file is None:
        raise MixlensError(
            "--view segments draws a saved explanation with segments (--from FILE); for TEXT use mixlens explain "
            "with --chat, --span, --marker or --separator and --format png"
        )
    res = read_saved(from_file, text, None)
    if getattr(res, "segments", None) is None:
        raise MixlensError(
            f"{from_file} holds no segments (explain with --chat, --span, --marker or --separator, -f json -o FILE)"
        )
    if len(res.texts) > MAX_PANELS:
        raise MixlensError(f"{from_file} holds {len(res.texts)} inputs: a segments figure holds at most {MAX_PANELS}")
    static.save_figure(segments_figure(res), out)
    typer.echo(f"wrote the segments figure to {out}", err=True)


def with_request(
    lens: Any, methods: list[str], options: dict[str, dict[str, object]], target: str | None, foil: str | None
) -> tuple[dict[str, dict[str, object]], Any]:
    """`options` with `--target` / `--foil` (a class or token, as text or id, resolved as `explain` does) given to
    every method that declares the registry's target options (`TARGET_OPTIONS`), and a function naming a class /
    token id for the report's note on what the scores explain."""
    from mixlens.methods import get
    from mixlens.methods.registry import TARGET_OPTIONS
    from mixlens.targets import model_kind, resolve_index, token_label

    kind = model_kind(lens.model)
    config = lens.model.config

    def label(v: Any) -> str:
        if not isinstance(v, int) or isinstance(v, bool):
            return str(v)
        if kind == "classifier":
            return f"'{(getattr(config, 'id2label', None) or {}).get(v, v)}'"
        return f"'{token_label(lens.tokenizer, v)}'"

    request = {"target": target, "foil": foil}
    if all(v is None for v in request.values()):
        return options, label
    keys = {o.name for o in TARGET_OPTIONS} & set(request)
    takers = [m for m in methods if keys <= {o.name for o in get(m).options}]
    if not takers:
        raise MixlensError(
            f"--target / --foil: none of {', '.join(methods)} takes a target; add a method that does (mixlens methods "
            "lists each method's options)"
        )
    out = {m: dict(o) for m, o in options.items()}
    for key, spec in request.items():
        if spec is None:
            continue
        value = resolve_index(kind, config, lens.tokenizer, spec)  # as explain reads it: a text keeps its spaces
        for m in takers:
            if key in out.get(m, {}) and out[m][key] != value:
                raise MixlensError(f"--{key} and --option {m}.{key} disagree: give the {key} once")
            out.setdefault(m, {})[key] = value
    return out, label


def analyze_for_view(
    lens: LensLike, texts: list[str], methods: Sequence[str], *, heads: bool = True, **kwargs: Any
) -> tuple[Analysis, dict[str, Attribution]]:
    """Run `methods` on `texts` for a report: their own (head-summed) maps, plus — with `heads` — per-head maps
    of the methods that have them (a second pass), for the head selector. Keyword args go to `lens.analyze`; a
    report shows full maps (every target row)."""
    from mixlens.methods import get

    kwargs.setdefault("rows", "all")
    res = lens.analyze(texts, methods, **kwargs)
    with_heads = [m for m in res.attributions if get(m).head_dims]
    if not (heads and with_heads):
        return res, {}
    opts = {k: v for k, v in (kwargs.pop("options", None) or {}).items() if k in with_heads}
    per_head = lens.analyze(texts, with_heads, heads=True, options=opts, **kwargs)
    return res, dict(per_head.attributions)


@dataclass
class ModelAnalyzer:
    """The viewer's `viz.server.Analyzer` over a loaded model: `mixlens serve` runs the model, the viewer only
    serves pages."""

    lens: LensLike
    methods: list[str]
    heads: bool = True

    @property
    def name(self) -> str:
        return str(self.lens.name)

    def count_tokens(self, text: str) -> int:
        return len(self.lens.tokenizer(text)["input_ids"])

    def analyze(self, text: str) -> tuple[Analysis, dict[str, Attribution]]:
        return analyze_for_view(self.lens, [text], self.methods, heads=self.heads)


def register(app: typer.Typer) -> None:
    @app.command()
    @runtime_options
    def report(
        text: list[str] = typer.Argument(None, help="One or more texts to analyse (or --from FILE)."),
        out: Path = typer.Option(
            Path("mixlens-report.html"), "--out", "-o", help="The HTML file to write.", callback=writable_file
        ),
        model: str | None = model_option(),
        gguf_file: str | None = gguf_file_option(),
        method: list[str] = method_list_option(),
        heads: bool = typer.Option(True, "--heads/--no-heads", help="Also embed per-head maps (head selector)."),
        option: list[str] = method_options_option(),
        max_length: int | None = max_length_option(),
        max_values: int = typer.Option(
            4_000_000,
            "--max-values",
            min=1,
            help="Most numbers embedded in the "
            "file; per-head maps, then methods, are left out beyond it (said on the "
            "page).",
        ),
        title: str | None = typer.Option(None, "--title", help="Page title."),
        model_head: str | None = model_head_option(),
        allow_random_head: bool = allow_random_head_option(),
        from_file: Path | None = from_option(),
        target: str | None = typer.Option(
            None,
            "--target",
            help="What the methods that take a target explain: a class index or label (classifiers), or a token "
            "(LMs; as text, with its leading space: ' are'), as explain takes it; default: the prediction.",
        ),
        foil: str | None = typer.Option(
            None, "--foil", help="Contrast class / token (as --target): explain logit(target) − logit(foil)."
        ),
        runtime: Runtime = NO_RUNTIME,
    ) -> None:
        """Write ONE self-contained HTML report (no network requests): heatmap, token links, mixing ratios,
        highlighted text for per-token methods (the report says what their scores explain)."""
        from mixlens.result import atomic_write
        from mixlens.viz.html import render_report

        if out.suffix.lower() not in (".html", ".htm"):
            raise MixlensError(f"--out must end in .html, not '{out.name}'")
        check_writable(out)  # before the file is read or the model loads
        head_maps: dict[str, Any] = {}
        label = None
        if from_file is not None:
            if target is not None or foil is not None:
                raise MixlensError(
                    "--target / --foil choose what a new analysis explains; a saved one (--from) has its own"
                )
            res = read_saved(from_file, text, method)
        else:
            if not text:
                raise MixlensError("give one or more texts, or --from FILE")
            methods = check_methods(method)
            opts = parse_options(option)
            precheck_model(model, model_head, methods, text, max_length, gguf_file)
            lens = runtime.load(model, gguf_file=gguf_file, head=model_head, allow_random_head=allow_random_head)
            opts, label = with_request(lens, methods, opts, target, foil)
            with method_progress(methods, len(text)) as step:
                res, head_maps = analyze_for_view(
                    lens, text, methods, heads=heads, options=opts, max_length=max_length, on_batch=step
                )
        page = render_report(res, head_maps=head_maps, title=title, max_values=max_values, label=label)
        atomic_write(out, page.encode())
        typer.echo(f"wrote report to {out}", err=True)

    @app.command()
    @runtime_options
    def plot(
        text: list[str] = typer.Argument(None, help="One or more texts (one panel each; ratio: pooled), or --from."),
        out: Path = typer.Option(..., "--out", "-o", help="Figure file: .png, .svg or .pdf.", callback=writable_file),
        model: str | None = model_option(),
        gguf_file: str | None = gguf_file_option(),
        view: View = typer.Option(
            View.heatmap,
            "--view",
            help="heatmap, bipartite, ratio, routes, logit-layers (alti_logit / logit_attn per layer; --from an "
            "explanation, or TEXT) or segments (ranked segments and answer tokens × segments; --from an explanation "
            "with segments).",
        ),
        method: str = typer.Option(
            PLOT_METHOD,
            "--method",
            help="Method for heatmap/bipartite; logit-layers: alti_logit or logit_attn (from a file holding both: "
            "required).",
        ),
        layer: int = typer.Option(-1, "--layer", help="Layer (0-based; negative counts from the end)."),
        attention_head: int | None = typer.Option(
            None, "--attention-head", min=0, help="One attention head (0-based) instead of the method's own map."
        ),
        old_head: str | None = typer.Option(None, "--head", hidden=True, help="Renamed: --attention-head."),
        option: list[str] = method_options_option(),
        max_length: int | None = max_length_option(),
        model_head: str | None = model_head_option(),
        allow_random_head: bool = allow_random_head_option(),
        from_file: Path | None = from_option(),
        runtime: Runtime = NO_RUNTIME,
    ) -> None:
        """Save a publication figure (matplotlib) of the heatmap, bipartite or mixing-ratio view; per-token methods
        (saliency, decompx_classes, ...) are drawn as highlighted text."""
        from mixlens.methods import get
        from mixlens.viz import static

        if old_head is not None:
            raise MixlensError(
                "plot's --head is now --attention-head (an attention head number); --model-head picks the model's "
                "output head"
            )
        head = attention_head
        if view is View.logit_layers:
            _logit_layers(text, out, model, gguf_file, method, model_head, from_file, runtime)
            return
        if view is View.segments:
            _segments(text, out, from_file)
            return
        if view is View.routes:
            method = catalog.defaults("routes")[0]  # the routes figure draws this method's graph
        suffix = out.suffix.lower().lstrip(".")
        if suffix not in static.FORMATS:
            raise MixlensError(f"--out must end in .png, .svg or .pdf, not '{out.name}'")
        if out.is_dir():
            raise MixlensError(f"cannot write '{out}': it is a directory; give a file name")
        spec = get(method)
        vector = spec.dims[-1] == "source" and spec.dims[-2:] != ("target", "source")
        if head is not None and view is not View.ratio and not spec.head_dims:
            raise MixlensError(f"'{method}' has no per-head values; drop --attention-head")
        methods = catalog.defaults("ratio")[:1] if view is View.ratio else [method]
        if from_file is not None:
            res = read_saved(from_file, text, None)
            if view is View.ratio and not res.ratio_store:
                raise MixlensError(f"{from_file} holds no mixing ratios (analyse with a norm method, e.g. norm)")
            if view is not View.ratio:
                res[method]  # noqa: B018  (refuses a method the file does not hold, naming those it has)
        else:
            if not text:
                raise MixlensError("give one or more texts, or --from FILE")
            if view is not View.ratio and len(text) > MAX_PANELS:
                raise MixlensError(f"{len(text)} texts: a {view.value} figure holds at most {MAX_PANELS} panels")
            opts = parse_options(option)
            precheck_model(model, model_head, methods, text, max_length, gguf_file)
            lens = runtime.load(model, gguf_file=gguf_file, head=model_head, allow_random_head=allow_random_head)
            with method_progress(methods, len(text)) as step:
                res = lens.analyze(
                    text,
                    methods,
                    heads=head is not None,
                    options=opts,
                    max_length=max_length,
                    on_batch=step,
                    rows="all",  # figures of full maps
                )
        if view is not View.ratio and len(res.texts) > MAX_PANELS:
            raise MixlensError(
                f"{from_file} holds {len(res.texts)} inputs: a {view.value} figure holds at most {MAX_PANELS} panels"
            )
        inputs = list(range(len(res.texts)))
        if view is View.ratio:
            fig = static.ratio_figure(res)
        elif view is View.routes:
            from mixlens.viz.routes import routes_figure

            fig = routes_figure(res[method], inputs)
        elif vector:
            fig = static.token_scores_figure(res[method], inputs)
        elif view is View.heatmap:
            fig = static.heatmap_figure(res[method], inputs, layer, head)
        else:
            fig = static.bipartite_figure(res[method], inputs, layer, head)
        static.save_figure(fig, out)
        shown = "highlighted-text" if vector and view is not View.ratio else view.value
        typer.echo(
            f"wrote {shown} figure of {methods[0] if view is not View.ratio else 'mixing ratios'} to {out}", err=True
        )

    @app.command()
    @runtime_options
    def serve(
        files: list[Path] = typer.Argument(None, help="Report files the viewer may also serve (by name)."),
        model: str | None = model_option(),
        gguf_file: str | None = gguf_file_option(),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: loopback only)."),
        port: int = typer.Option(8765, "--port", "-p", min=0, max=65535, help="Port (0: any free port)."),
        method: list[str] = method_list_option(),
        heads: bool = typer.Option(True, "--heads/--no-heads", help="Per-head maps for the head selector."),
        max_chars: int = typer.Option(1000, "--max-chars", min=1, help="Longest accepted input in characters."),
        max_tokens: int = typer.Option(128, "--max-tokens", min=2, help="Longest accepted input in tokens."),
        runtime: Runtime = NO_RUNTIME,
    ) -> None:
        """Local viewer: type a sentence in the browser and get the report view."""
        import os
        import sys

        from mixlens.viz.server import ViewerConfig, make_server, report_files

        methods = check_methods(method)
        given = report_files(files or [])
        lens = runtime.load(model, gguf_file=gguf_file)
        try:
            cfg = ViewerConfig(ModelAnalyzer(lens, methods, heads), max_chars, max_tokens, given)
            server = make_server(cfg, host, port)
        except OSError as e:
            raise MixlensError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        if host not in ("127.0.0.1", "localhost", "::1"):
            typer.echo(f"warning: listening on {host}: other machines can reach this viewer", err=True)
        addr, bound = str(server.server_address[0]), server.server_address[1]
        typer.echo(
            f"mixlens viewer on http://{'[' + addr + ']' if ':' in addr else addr}:{bound}/ (Ctrl-C stops it)", err=True
        )
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            if not server.stop(wait=2.0):  # model code running in a thread at exit can abort the interpreter
                typer.echo("stopped (the analysis in progress was abandoned)", err=True)
                sys.stderr.flush()
                os._exit(0)
            typer.echo("stopped", err=True)
        finally:
            server.server_close()
