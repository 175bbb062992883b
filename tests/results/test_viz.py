"""HTML report payload and page, static figures, report/plot CLI (no browser; see test_browser.py)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest

from mixlens.cli import main
from mixlens.commands.report import analyze_for_view
from mixlens.errors import MixlensError
from mixlens.methods.norms import RATIO_VARIANTS
from mixlens.result import Analysis, Attribution
from mixlens.viz import html as vh
from mixlens.viz import static

TEXTS = ["The keys to the cabinet are on the table.", "Short one."]


@pytest.fixture(scope="module")
def views(bundled):
    """(head-summed analysis, per-head maps) of the bundled model."""
    return analyze_for_view(bundled, TEXTS, ["attention", "norm", "norm_resln"])


class Scripts(HTMLParser):
    """Collects <script> elements (attributes, text) and <meta> tags of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[tuple[dict, str]] = []
        self.metas: list[dict] = []
        self._open: dict | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "script":
            self._open, self._text = dict(attrs), ""
        elif tag == "meta":
            self.metas.append(dict(attrs))

    def handle_data(self, data):
        if self._open is not None:
            self._text += data

    def handle_endtag(self, tag):
        if tag == "script" and self._open is not None:
            self.scripts.append((self._open, self._text))
            self._open = None


def parse(doc: str) -> Scripts:
    p = Scripts()
    p.feed(doc)
    return p


def run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


def test_round_sig_matches_printf_rounding():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(2000) * 10.0 ** rng.integers(-12, 12, 2000)
    x[:3] = [0.0, np.nan, np.inf]
    got = vh.round_sig(x)
    want = [0.0, 0.0, 0.0] + [float(f"{v:.4g}") for v in x[3:]]
    assert [repr(v) for v in got.tolist()] == [repr(v) for v in want]  # same double: same short JSON text


def test_payload_holds_the_right_cells(views):
    res, heads = views
    p = vh.build_payload(res, head_maps=heads)
    assert [m["name"] for m in p["methods"]] == ["attention", "norm", "norm_resln"]
    for m in p["methods"]:
        assert [a["name"] for a in m["axes"]] == ["layer"]
        for b in range(len(TEXTS)):
            n = len(res.tokens[b])
            vals = np.array(m["values"][b]).reshape(6, n, n)
            np.testing.assert_allclose(vals, res[m["name"]].input(b), rtol=6e-4, atol=1e-7)
            if m["name"] in heads:
                hv = np.array(m["head_values"][b]).reshape(6, 12, n, n)
                np.testing.assert_allclose(hv, heads[m["name"]].input(b), rtol=6e-4, atol=1e-7)
    assert p["methods"][2]["head_values"] is None and p["methods"][2]["heads"] == 0
    # the head selector's "all" is the method's own map: the mean of attention heads, not of norm heads
    att_mean = heads["attention"].input(0).mean(1)
    np.testing.assert_allclose(res["attention"].input(0), att_mean, rtol=1e-5, atol=1e-7)
    assert not np.allclose(res["norm"].input(0), heads["norm"].input(0).mean(1), rtol=1e-2)
    for b in range(len(TEXTS)):
        for v in RATIO_VARIANTS:
            r = res.ratios[v][b, :, : len(res.tokens[b])].mean(-1)
            np.testing.assert_allclose(p["inputs"][b]["ratios"][v], r, rtol=6e-4)
    assert p["notes"] == []


def test_own_head_axis_shows_mean_and_heads(views):
    _, heads = views
    res = Analysis(
        "m",
        "0",
        TEXTS,
        heads["norm"].tokens,
        {"norm": heads["norm"]},
        {v: np.zeros((2, 6, 12)) for v in RATIO_VARIANTS},
        np.zeros(2),
    )
    m = vh.build_payload(res)["methods"][0]
    n = len(res.tokens[1])
    assert m["all_label"] == "mean over heads" and m["heads"] == 12
    np.testing.assert_allclose(
        np.array(m["values"][1]).reshape(6, n, n), heads["norm"].input(1).mean(1), rtol=6e-4, atol=1e-7
    )


def test_caps_are_stated(views):
    res, heads = views
    full = vh.build_payload(res, head_maps=heads)
    base = sum(len(v) for m in full["methods"] for v in m["values"])
    p = vh.build_payload(res, head_maps=heads, max_values=base)
    assert all(m["head_values"] is None for m in p["methods"])
    assert any("per-head maps left out" in t for t in p["notes"])
    per_method = sum(len(v) for v in full["methods"][0]["values"])
    p = vh.build_payload(res, max_values=2 * per_method)
    assert [m["name"] for m in p["methods"]] == ["attention", "norm"]
    assert any("norm_resln" in t and "left out" in t for t in p["notes"])
    p = vh.build_payload(res, max_tokens=5)
    assert p["inputs"][0]["tokens"] == res.tokens[0][:5] and len(p["inputs"][0]["tokens"]) == 5
    assert any("first 5 of 12 tokens" in t for t in p["notes"])
    vals = np.array(p["methods"][0]["values"][0]).reshape(6, 5, 5)
    np.testing.assert_allclose(vals, res["attention"].input(0)[:, :5, :5], rtol=6e-4, atol=1e-7)


def test_non_map_methods_are_scores_or_named():
    """Per-token methods become highlighted-text rows (one per class); other non-map axes are named in a note."""
    toks = [["[CLS]", "a", "[SEP]"]]
    scores = np.array([[[1.0, 2.0, 3.0], [-1.0, 0.0, 0.5]]])  # [batch, class, source]
    per_class = Attribution(scores, ("class", "source"), toks, "decompx_classes")
    per_layer = Attribution(np.ones((1, 2)), ("layer",), toks, "scalar")
    signed = Attribution(
        np.array([[[[0.5, -1.0, 0], [0, 1, 0], [0, 0, 2.0]]]]), ("class", "target", "source"), toks, "signed"
    )
    attrs = {"decompx_classes": per_class, "signed": signed, "scalar": per_layer}
    res = Analysis("m", "0", ["a"], toks, attrs, {}, np.zeros(1))
    p = vh.build_payload(res)
    assert [m["name"] for m in p["methods"]] == ["signed"]
    assert p["methods"][0]["signed"] and p["methods"][0]["axes"] == [{"name": "class", "size": 1}]
    rows = p["scores"][0]["rows"]
    assert p["scores"][0]["name"] == "decompx_classes" and [r["label"] for r in rows] == [
        "input 1, class 0",
        "input 1, class 1",
    ]
    assert rows[0]["values"] == [1.0, 2.0, 3.0] and rows[1]["values"] == [-1.0, 0.0, 0.5]
    assert any("'scalar' has axes (layer)" in t and "--format json" in t for t in p["notes"])
    markup = vh.render_report(res)
    assert markup.count('<span title="') == 6 and 'title="-1"' in markup


def test_page_is_self_contained_and_csp_pins_the_script(views):
    res, heads = views
    doc = vh.render_report(res, head_maps=heads)
    page = parse(doc)
    csp = [m["content"] for m in page.metas if m.get("http-equiv") == "Content-Security-Policy"]
    assert len(csp) == 1 and "default-src 'none'" in csp[0] and "unsafe-inline" not in csp[0].split("style-src")[0]
    code = [t for a, t in page.scripts if "type" not in a]
    assert len(code) == 1
    digest = base64.b64encode(hashlib.sha256(code[0].encode()).digest()).decode()
    assert f"'sha256-{digest}'" in csp[0]
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:|//)", doc, re.I)
    assert "@import" not in doc and "url(" not in doc and "fetch(" not in doc and "XMLHttpRequest" not in doc
    data = [t for a, t in page.scripts if a.get("type") == "application/json"]
    assert json.loads(data[0])["inputs"][1]["tokens"] == res.tokens[1]


def test_hostile_tokens_stay_data():
    toks = [["</script><script>alert(1)</script>", "<!--", "&amp;"]]
    a = Attribution(np.eye(3)[None, None], ("layer", "target", "source"), toks, "x")
    doc = vh.render_report(a)
    assert doc.count("<script") == 2  # the JSON block and the code: no injected element
    data = [t for at, t in parse(doc).scripts if at.get("type") == "application/json"]
    assert json.loads(data[0])["inputs"][0]["tokens"] == toks[0]


def test_notebook_fragments_do_not_clash(views):
    res, _ = views
    one, two = res._repr_html_(), res._repr_html_()
    ids = [re.findall(r'<div class="mlx-report" id="([^"]+)"', f)[0] for f in (one, two)]
    assert ids[0] != ids[1]
    for f, uid in zip((one, two), ids, strict=True):
        code = [t for a, t in parse(f).scripts if "type" not in a][0]
        assert code.startswith("(function(){") and code.rstrip().endswith("})();")  # no globals
        assert json.dumps(uid) in code and json.dumps(uid + "-data") in code
    frag = res["norm"]._repr_html_()
    assert json.loads([t for a, t in parse(frag).scripts if a.get("type")][0])["inputs"][0]["ratios"] is None


def test_select_map_and_figures(views):
    res, heads = views
    m, desc = static.select_map(res["norm"], 0, 2)
    np.testing.assert_array_equal(m, res["norm"].input(0)[2])
    assert desc == "layer 2"
    m, desc = static.select_map(heads["attention"], 1, -1, 3)
    np.testing.assert_array_equal(m, heads["attention"].input(1)[5, 3])
    assert desc == "layer 5, head 3"
    m, desc = static.select_map(heads["attention"], 0, 1)
    np.testing.assert_allclose(m, res["attention"].input(0)[1], rtol=1e-5, atol=1e-7)
    assert desc == "layer 1, mean over heads"
    with pytest.raises(MixlensError, match="layer 6 out of range"):
        static.select_map(res["norm"], 0, 6)
    with pytest.raises(MixlensError, match="no per-head values"):
        static.select_map(res["norm_resln"], 0, 0, 1)
    with pytest.raises(MixlensError, match="head 12 out of range"):
        static.select_map(heads["norm"], 0, 0, 12)

    fig = static.heatmap_figure(res["norm_resln"], [0, 1], 4)
    img_axes = [ax for ax in fig.axes if ax.images]
    assert len(img_axes) == 2 and len(fig.axes) == 4  # two panels, two colour bars
    np.testing.assert_array_equal(img_axes[1].images[0].get_array(), res["norm_resln"].input(1)[4])
    assert [t.get_text() for t in img_axes[0].get_xticklabels()] == res.tokens[0]

    fig = static.ratio_figure(res)
    lines = {ln.get_label(): ln.get_ydata() for ln in fig.axes[0].lines}
    counts = sum(len(t) for t in res.tokens)
    for v in RATIO_VARIANTS:
        np.testing.assert_allclose(lines[v], 100 * res.ratios[v].sum((0, 2)) / counts, rtol=1e-6)


def test_bipartite_draws_the_strongest_links(views):
    res, _ = views
    fig = static.bipartite_figure(res["norm"], [0], 0, max_links=5)
    segs = fig.axes[0].collections[0].get_segments()
    m = res["norm"].input(0)[0]
    top5 = {tuple(np.unravel_index(k, m.shape)) for k in np.argsort(m, axis=None)[-5:]}
    assert {(int(s[1, 1]), int(s[0, 1])) for s in segs} == top5  # (target i, source j)


def test_report_and_plot_cli(tmp_path):
    out = tmp_path / "r.html"
    assert run_cli(["report", TEXTS[1], "--method", "attention", "--method", "norm", "--out", str(out)]) == 0
    p = json.loads([t for a, t in parse(out.read_text()).scripts if a.get("type")][0])
    assert [m["name"] for m in p["methods"]] == ["attention", "norm"] and p["methods"][1]["heads"] == 12
    out2 = tmp_path / "a.html"
    assert run_cli(["analyze", TEXTS[1], "--format", "html", "--out", str(out2)]) == 0
    assert "default-src 'none'" in out2.read_text()
    magic = {"png": b"\x89PNG", "svg": b"<?xml", "pdf": b"%PDF"}
    for view, ext in (("heatmap", "png"), ("ratio", "svg"), ("bipartite", "pdf")):
        f = tmp_path / f"f.{ext}"
        assert (
            run_cli(
                [
                    "plot",
                    TEXTS[1],
                    "--view",
                    view,
                    "--out",
                    str(f),
                    "--method",
                    "attention",
                    "--layer",
                    "1",
                    "--attention-head",
                    "0",
                ]
            )
            == 0
        )
        assert f.read_bytes().startswith(magic[ext])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "x", "--out", "r.txt"], "--out must end in .html"),
        (["report", "x", "--method", "nope", "--out", "r.html"], "unknown method 'nope'"),
        (["plot", "x", "--out", "f.gif"], "must end in .png, .svg or .pdf"),
        (["plot", "x", "--out", "f.png", "--method", "norm_res", "--attention-head", "1"], "no per-head values"),
        (["plot", "x", "--out", "f.png", "--head", "1"], "plot's --head is now --attention-head"),
        (["plot", "x", "--out", "f.png", "--layer", "6"], "layer 6 out of range"),
        (["plot", "a", "b", "c", "d", "e", "--out", "f.png"], "at most 4 panels"),
        (["serve", "missing.html"], "no such report file"),
    ],
)
def test_cli_errors(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_head_figures_draw_the_given_values(tmp_path):
    import matplotlib.image as mpimg

    from mixlens.viz import heads as vhd

    grid = np.array([[0.5, -1.0, 0.25], [0.0, 2.0, -0.75]])  # [layer, head]
    vhd.layer_head_heatmap(grid, "t", tmp_path / "sub" / "g.png", cmap="RdBu", center=True)
    assert mpimg.imread(tmp_path / "sub" / "g.png").shape[2] in (3, 4)
    shares = np.array([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]])
    vhd.pattern_shares_figure(shares, ("a", "b", "c"), "p", tmp_path / "p.svg")
    svg = (tmp_path / "p.svg").read_text()
    assert svg.count('<g id="patch_') >= 2 + 6  # background patches + one bar per (layer, pattern)
    coords = np.array([[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]])
    vhd.head_mds_figure(
        coords,
        np.array([0, 0, 1]),
        np.array([0, 1, 0]),
        np.array(["x", "broad", "x"]),
        ["x", "broad"],
        "m",
        tmp_path / "m.svg",
    )
    svg = (tmp_path / "m.svg").read_text()
    assert all(f"L{la}H{h}" in svg for la, h in ((0, 0), (0, 1), (1, 0)))


def test_head_figure_labels_are_readable():
    from matplotlib import colormaps

    from mixlens.viz.heads import _number, _text_colour, statistic_words

    assert [_number(v) for v in (-0.004, 0.004, -0.006, 0.0)] == ["0.00", "0.00", "-0.01", "0.00"]
    assert _number(-0.0004, 3) == "0.000" and _number(-0.0206, 3) == "-0.021"
    assert _text_colour(colormaps["RdBu"](0.5)) == "k" and _text_colour(colormaps["RdBu"](0.0)) == "w"
    assert _text_colour(colormaps["magma"](1.0)) == "k" and _text_colour(colormaps["magma"](0.0)) == "w"
    assert statistic_words("norm_cls") == "mass on [CLS], norm-based contributions ‖αf(x)‖"


def _blocks_attribution(lengths: list[int], seed: int = 0) -> Attribution:
    """A [layer=2, target, source] attribution stored per input (one block each), as `Lens.analyze` stores it."""
    from mixlens.result import InputRows

    rng = np.random.default_rng(seed)
    parts = [(np.array([b]), rng.random((1, 2, n, n)).astype(np.float32)) for b, n in enumerate(lengths)]
    tokens = [[f"t{k}" for k in range(n)] for n in lengths]
    dims = ("layer", "target", "source")
    return Attribution(InputRows(parts, dims, lengths), dims, tokens, "m")


def test_payload_is_built_per_input_without_padding(monkeypatch):
    """#32 D: the payload read `.values` (every input padded to the longest: 200 two-token texts and one 500-token
    text took 5.4 GB); it is built per input from `.input(b)`."""
    from mixlens.result import InputRows

    attr = _blocks_attribution([2] * 20 + [40])

    def padded(self):
        raise AssertionError("the padded [batch, ...] array was built")

    monkeypatch.setattr(InputRows, "full", padded)
    payload = vh.build_payload(attr)
    (m,) = payload["methods"]
    assert m["axes"] == [{"name": "layer", "size": 2}]
    assert [len(v) for v in m["values"]] == [2 * 2 * 2] * 20 + [2 * 40 * 40]
    np.testing.assert_allclose(m["values"][20], vh.round_sig(attr.input(20)).ravel())


def test_nan_and_inf_are_marked_not_drawn_as_zero():
    """#32 D: NaN and ±inf were drawn as 0; they reach the page as null / "inf" / "-inf" and are marked."""
    attr = _blocks_attribution([3])
    v = attr.input(0)
    v[1, 0, 0], v[1, 0, 1], v[1, 0, 2] = np.nan, np.inf, -np.inf
    payload = vh.build_payload(attr)
    last = payload["methods"][0]["values"][0][9:12]  # layer 1, target 0
    assert last == [None, "inf", "-inf"] and not payload["methods"][0]["signed"]
    vh.render_report(attr)  # the JSON holds no NaN (allow_nan=False would refuse it)
    scores = Attribution(np.array([[0.5, np.nan, np.inf]], np.float32), ("source",), [["a", "b", "c"]], "s")
    markup = vh.render_report(scores)
    assert 'class="mlx-nonfinite" title="nan"' in markup and 'class="mlx-nonfinite" title="inf"' in markup
    assert vh.NONFINITE in markup
    js = vh.asset("report.js")
    assert 'v === null ? NaN : v === "inf" ? Infinity' in js and "NaN or \\u00b1inf" in js


NODE_DOM = """
function ctx2d() {
  return new Proxy({}, { get(t, k) {
    if (k === "measureText") return () => ({ width: 10 });
    if (k === "createImageData") return (w, h) => ({ data: new Uint8ClampedArray(4 * w * h) });
    return k in t ? t[k] : () => {};
  }, set(t, k, v) { t[k] = v; return true; } });
}
function makeEl(tag) {
  return { tag, children: [], attrs: {}, style: {}, ownerDocument: doc,
    appendChild(c) { this.children.push(c); return c; }, setAttribute(k, v) { this.attrs[k] = String(v); },
    addEventListener() {}, getContext() { return this._ctx || (this._ctx = ctx2d()); },
    getBoundingClientRect() { return { left: 0, top: 0 }; } };
}
var doc = { defaultView: { devicePixelRatio: 1 }, createElement: makeEl, createTextNode: (t) => ({ text: t }) };
function find(e, pred) {
  if (pred(e)) return e;
  for (const c of e.children || []) { const r = find(c, pred); if (r) return r; }
  return null;
}
const root = makeEl("div");
mlxMount(root, JSON.parse(require("fs").readFileSync(0, "utf8")));
const m = root.mixlens.map(), s = root.mixlens.state();
const note = find(root, (e) => e.attrs && e.attrs["data-nonfinite"] !== undefined);
console.log(JSON.stringify({ nan: Number.isNaN(m[0]), inf: m[4] === Infinity, vmin: s.vmin, vmax: s.vmax,
                             bad: note.attrs["data-nonfinite"], text: note.textContent }));
"""


def test_view_marks_nan_and_inf_cells():
    """#32 D: the view (report.js, run in node with a stub DOM) keeps NaN/inf cells as such, leaves them out of the
    colour scale and says how many there are."""
    import shutil
    import subprocess

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    v = np.random.default_rng(0).random((1, 2, 3, 3)).astype(np.float32)
    v[0, 0, 0, 0], v[0, 0, 1, 1] = np.nan, np.inf
    payload = vh.build_payload(Attribution(v, ("layer", "target", "source"), [["a", "b", "c"]], "m"))
    payload["inputs"][0]["ratios"] = {"W": [0.5, None]}
    run = subprocess.run(
        [node, "-e", vh.asset("report.js") + NODE_DOM], input=json.dumps(payload), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    finite = v[0, 0][np.isfinite(v[0, 0])]
    assert got["nan"] and got["inf"] and got["bad"] == "2" and "2 cells are NaN or" in got["text"]
    assert got["vmin"] == 0 and got["vmax"] == pytest.approx(finite.max(), rel=1e-3)


NODE_SELECT = (
    NODE_DOM.split("const m = root.mixlens.map()")[0]
    + """
const sel = find(root, (e) => e.attrs && e.attrs["data-role"] === "method");
console.log(JSON.stringify({ shown: sel.value, state: root.mixlens.state().method,
                             options: sel.children.map((o) => o.children[0] && o.children[0].text) }));
"""
)


def test_method_selector_shows_the_method_the_map_opens_on(views):
    """#32.8: the Method dropdown showed "attention" (its first option) while the map showed norm_resln (the start
    method), so choosing "attention" changed nothing. Run in node with a stub DOM: the selector's value is the start
    method's index."""
    import shutil
    import subprocess

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    res, heads = views
    payload = vh.build_payload(res, head_maps=heads)
    names = [m["name"] for m in payload["methods"]]
    assert names[0] == "attention" and names[payload["start_method"]] == "norm_resln"
    run = subprocess.run(
        [node, "-e", vh.asset("report.js") + NODE_SELECT], input=json.dumps(payload), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["state"] == "norm_resln" and got["shown"] == str(payload["start_method"]), got


def test_report_shows_unnormalised_rollouts_with_rows_to_one(bundled):
    """#32 A5: the report draws the plain products of unnormalised maps (their scale drifts with depth) with rows
    scaled to sum to 1, and says so; normalised methods are drawn as they are."""
    from mixlens.viz.html import build_payload

    res = bundled.analyze(["The keys to the cabinet are on the table."], ["globenc_rollout", "attention"])
    payload = build_payload(res)
    by_name = {m["name"]: m for m in payload["methods"]}
    n = len(res.tokens[0])
    rows = np.asarray(by_name["globenc_rollout"]["values"][0], dtype=float).reshape(-1, n, n).sum(-1)
    np.testing.assert_allclose(rows, 1.0, atol=1e-3)
    raw = res["globenc_rollout"].input(0).sum(-1)
    assert not np.allclose(raw, 1.0, atol=1e-3)  # the stored values keep the official convention
    assert any("globenc_rollout" in note and "sum to 1" in note for note in payload["notes"])
    att = np.asarray(by_name["attention"]["values"][0], dtype=float)
    np.testing.assert_allclose(
        att, np.asarray([round(float(x), 6) for x in res["attention"].input(0).ravel()]), atol=1e-3
    )
