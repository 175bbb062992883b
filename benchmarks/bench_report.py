"""Report scale check: a 128-token input with 16 methods of a 12-layer, 12-head model (synthetic values; the
view does not care where they came from). Prints file size, build time and — when chromium + selenium are
installed — load and method/layer switch times in headless Chromium, measured in one run."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mixlens.methods.norms import RATIO_VARIANTS
from mixlens.result import Analysis, Attribution
from mixlens.viz.html import render_report

L, H, N = 12, 12, 128
NAMES = ["attention", "norm", "norm_res", "norm_resln", "attention_rollout", "alti", "alti_rollout", "globenc",
         "globenc_rollout", "value_zeroing", "value_zeroing_rollout", "decompx", "hta", "head_attribution",
         "attention_flow", "grad_x_input"]


def synthetic() -> tuple[Analysis, dict[str, Attribution]]:
    rng = np.random.default_rng(0)
    toks = [["[CLS]", *[f"tok{k}" for k in range(N - 2)], "[SEP]"]]
    attrs = {m: Attribution(rng.random((1, L, N, N), dtype=np.float32), ("layer", "target", "source"), toks, m)
             for m in NAMES}
    heads = {m: Attribution(rng.random((1, L, H, N, N), dtype=np.float32), ("layer", "head", "target", "source"),
                            toks, m) for m in ("attention", "norm")}
    ratios = {v: rng.random((1, L, N), dtype=np.float32) for v in RATIO_VARIANTS}
    return Analysis("synthetic-12L", "0", [" ".join(toks[0])], toks, attrs, ratios, np.zeros(1)), heads


def main() -> None:
    res, heads = synthetic()
    t0 = time.perf_counter()
    doc = render_report(res, head_maps=heads)
    build = time.perf_counter() - t0
    print(f"values embedded: {len(NAMES)} methods x {L} layers x {N}x{N} (+ per-head for 2 methods, if they fit)")
    print(f"file size: {len(doc) / 1e6:.1f} MB, build time {build:.2f} s")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.support.ui import Select
    except ImportError:
        print("selenium not installed: browser timings skipped")
        return
    if not Path("/usr/bin/chromium").exists():
        print("chromium not installed: browser timings skipped")
        return
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1600"):
        opts.add_argument(a)
    drv = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp, "big.html")
            p.write_text(doc)
            t0 = time.perf_counter()
            drv.get(p.as_uri())
            load = time.perf_counter() - t0
            root = drv.find_element("css selector", ".mlx-report")
            ms = drv.execute_script(
                "var r=arguments[0], m=r.querySelector('select[data-role=method]'),"
                "l=r.querySelector('select[data-role=layer]'), t=performance.now();"
                "for (var k=0;k<10;k++){m.value=String(k%m.options.length);m.dispatchEvent(new Event('change'));"
                "l.value=String(k%12);l.dispatchEvent(new Event('change'));}"
                "return (performance.now()-t)/20;", root)
            Select(root.find_element("css selector", "select[data-role=method]")).select_by_index(1)
            notes = [e.text for e in root.find_elements("css selector", "[data-role=notes] li")]
    finally:
        drv.quit()
    print(f"chromium: page load {load:.2f} s; one method/layer switch (heatmap + links redraw) {ms:.0f} ms")
    print("notes on the page:", *notes, sep="\n  ")


if __name__ == "__main__":
    sys.exit(main())
