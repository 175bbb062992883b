"""Real-browser tests (headless Chromium via Selenium and the system chromedriver): the report, notebook outputs
and the local viewer. Screenshots of each view go to artifacts/browser/ (git-ignored). Skipped when selenium,
chromium or chromedriver is absent (.ci/run installs them)."""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from mixlens.commands.report import ModelAnalyzer, analyze_for_view
from mixlens.viz import html as vh
from mixlens.viz.server import ViewerConfig, make_server

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

BROWSER = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (BROWSER and DRIVER), reason="chromium and chromedriver not installed")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "browser"
TEXTS = ["The keys to the cabinet are on the table.", "Short one."]
RTOL = 6e-4  # 4 significant digits


@pytest.fixture(scope="module")
def drv():
    opts = webdriver.ChromeOptions()
    opts.binary_location = BROWSER
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1500",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
    ):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service(DRIVER))
    d.set_page_load_timeout(60)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield d
    d.quit()


@pytest.fixture(scope="module")
def views(bundled):
    return analyze_for_view(bundled, TEXTS, ["attention", "norm", "norm_resln"])


def errors(d) -> list[str]:
    """Console errors since the last call (CSP violations and failed requests are logged as SEVERE)."""
    return [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]


def state(d, root) -> dict:
    return d.execute_script("return arguments[0].mixlens.state()", root)


def shown(d, root, n: int) -> np.ndarray:
    return np.array(d.execute_script("return arguments[0].mixlens.map()", root)).reshape(n, n)


def pick(root, role: str, label: str) -> None:
    Select(root.find_element(By.CSS_SELECTOR, f"select[data-role={role}]")).select_by_visible_text(label)


def hover_cell(d, root, i: int, j: int) -> str:
    """Move the real mouse over heatmap cell (target i, source j); returns the tooltip text."""
    canvas = root.find_element(By.CSS_SELECTOR, "canvas[data-role=heatmap]")
    g = d.execute_script("return arguments[0].mixlens.geometry().heatmap", root)
    x = g["left"] + (j + 0.5) * g["cell"] - g["width"] / 2
    y = g["top"] + (i + 0.5) * g["cell"] - g["height"] / 2
    ActionChains(d).move_to_element_with_offset(canvas, int(x), int(y)).perform()
    return root.find_element(By.CSS_SELECTOR, ".mlx-tip").text


def snap(root, name: str) -> None:
    for role, view in (("heatmap", "heatmap"), ("bipartite", "bipartite"), ("ratio", "ratio")):
        card = root.find_element(By.CSS_SELECTOR, f"canvas[data-role={role}]").find_element(By.XPATH, "..")
        card.screenshot(str(ARTIFACTS / f"{name}-{view}.png"))


def test_report_switches_and_shows_the_right_cells(drv, views, tmp_path):
    res, heads = views
    f = tmp_path / "report.html"
    f.write_text(vh.render_report(res, head_maps=heads))
    drv.get(f.as_uri())
    root = drv.find_element(By.CSS_SELECTOR, ".mlx-report")
    assert root.get_attribute("data-ready") == "1"
    n = len(res.tokens[0])
    # the report opens on the decomposition (N-ResLN), not raw attention
    assert state(drv, root) == {**state(drv, root), "method": "norm_resln", "layer": 0, "head": -1, "n": n}
    np.testing.assert_allclose(shown(drv, root, n), res["norm_resln"].input(0)[0], rtol=RTOL, atol=1e-7)
    # #32.8: the Method selector said "attention" while the map was norm_resln, and choosing "attention" did nothing
    method_select = Select(root.find_element(By.CSS_SELECTOR, "select[data-role=method]"))
    assert method_select.first_selected_option.text == "norm_resln"
    pick(root, "method", "attention")
    assert state(drv, root)["method"] == "attention"
    np.testing.assert_allclose(shown(drv, root, n), res["attention"].input(0)[0], rtol=RTOL, atol=1e-7)

    pick(root, "method", "norm")
    pick(root, "layer", "3")
    assert (state(drv, root)["method"], state(drv, root)["layer"]) == ("norm", 3)
    np.testing.assert_allclose(shown(drv, root, n), res["norm"].input(0)[3], rtol=RTOL, atol=1e-7)
    pick(root, "head", "5")
    np.testing.assert_allclose(shown(drv, root, n), heads["norm"].input(0)[3, 5], rtol=RTOL, atol=1e-7)
    pick(root, "method", "norm_resln")  # no per-head maps: the head selector falls back to the method's map
    assert state(drv, root)["head"] == -1
    assert root.find_element(By.CSS_SELECTOR, "select[data-role=head]").get_attribute("disabled") == "true"
    np.testing.assert_allclose(shown(drv, root, n), res["norm_resln"].input(0)[3], rtol=RTOL, atol=1e-7)

    tip = hover_cell(drv, root, 2, 5)
    assert "target 2 \u201ckeys\u201d" in tip and "source 5 \u201ccabinet\u201d" in tip
    value = float(re.search(r"norm_resln: (\S+)", tip).group(1))
    assert value == pytest.approx(float(res["norm_resln"].input(0)[3, 2, 5]), rel=1e-3)
    snap(root, "report")

    ratio = root.find_element(By.CSS_SELECTOR, "canvas[data-role=ratio]")
    ActionChains(drv).move_to_element(ratio).perform()
    assert "ResLN-N:" in root.find_element(By.CSS_SELECTOR, ".mlx-tip").text
    legend = root.find_element(By.CSS_SELECTOR, ".mlx-legend").text
    assert f"ResLN-N (mean {100 * res.mixing_ratio('ResLN-N')[0].mean():.1f}%)" in legend

    pick(root, "input", "2: Short one.")
    m = len(res.tokens[1])
    np.testing.assert_allclose(shown(drv, root, m), res["norm_resln"].input(1)[3], rtol=RTOL, atol=1e-7)
    assert errors(drv) == []
    assert drv.execute_script("return performance.getEntriesByType('resource').length") == 0


def test_csp_blocks_any_request(drv, views, tmp_path):
    res, _ = views
    f = tmp_path / "csp.html"
    f.write_text(vh.render_report(res))
    drv.get(f.as_uri())
    blocked = drv.execute_async_script("""
        var done = arguments[arguments.length - 1];
        document.addEventListener('securitypolicyviolation', function (e) { done(e.blockedURI); });
        var img = document.createElement('img'); img.src = 'http://127.0.0.1:9/leak.png';
        document.body.appendChild(img);""")
    assert blocked.startswith("http://127.0.0.1:9")
    errors(drv)  # drain the (expected) violation report


def test_notebook_outputs_do_not_clash(drv, views, tmp_path):
    res, heads = views
    page = tmp_path / "notebook.html"
    page.write_text(
        "<!doctype html><html><body><div class='cell'>"
        + res._repr_html_()
        + "</div><div class='cell'>"
        + heads["norm"]._repr_html_()
        + "</div></body></html>"
    )
    drv.get(page.as_uri())
    first, second = drv.find_elements(By.CSS_SELECTOR, ".mlx-report")
    assert first.get_attribute("id") != second.get_attribute("id")
    assert first.get_attribute("data-ready") == second.get_attribute("data-ready") == "1"
    n = len(res.tokens[0])
    pick(second, "layer", "4")
    pick(second, "head", "2")
    np.testing.assert_allclose(shown(drv, second, n), heads["norm"].input(0)[4, 2], rtol=RTOL, atol=1e-7)
    assert (state(drv, first)["layer"], state(drv, first)["method"]) == (0, "norm_resln")
    np.testing.assert_allclose(shown(drv, first, n), res["norm_resln"].input(0)[0], rtol=RTOL, atol=1e-7)
    pick(first, "method", "norm")
    assert state(drv, second)["method"] == "norm" and state(drv, second)["layer"] == 4
    assert drv.execute_script("return typeof mlxMount === 'undefined' && typeof mlxViewer === 'undefined'")
    assert errors(drv) == []
    second.screenshot(str(ARTIFACTS / "notebook-second-output.png"))


def test_viewer_analyses_typed_text(drv, bundled):
    cfg = ViewerConfig(ModelAnalyzer(bundled, ["attention", "norm_resln"], heads=True), max_chars=300, max_tokens=20)
    srv = make_server(cfg, "127.0.0.1", 0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    origin = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        drv.get(origin + "/")
        area = drv.find_element(By.CSS_SELECTOR, "textarea[data-role=text]")
        area.send_keys("The dog chased the ball.")
        drv.find_element(By.CSS_SELECTOR, "button[data-role=submit]").click()
        root = WebDriverWait(drv, 60).until(lambda d: d.find_element(By.CSS_SELECTOR, ".mlx-report[data-ready='1']"))
        ref = bundled.analyze(["The dog chased the ball."], ["attention", "norm_resln"], heads=True)
        n = len(ref.tokens[0])
        np.testing.assert_allclose(shown(drv, root, n), ref["norm_resln"].input(0)[0], rtol=RTOL, atol=1e-7)
        pick(root, "method", "norm_resln")
        pick(root, "layer", "5")
        np.testing.assert_allclose(shown(drv, root, n), ref["norm_resln"].input(0)[5], rtol=RTOL, atol=1e-7)
        pick(root, "method", "attention")
        pick(root, "head", "7")
        np.testing.assert_allclose(shown(drv, root, n), ref["attention"].input(0)[5, 7], rtol=RTOL, atol=1e-7)
        assert "Done: " in drv.find_element(By.CSS_SELECTOR, "[data-role=status]").text
        snap(root, "viewer")
        drv.save_screenshot(str(ARTIFACTS / "viewer-page.png"))
        assert errors(drv) == []
        names = drv.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert names == [origin + "/api/analyze"]

        area.clear()
        area.send_keys(" ".join("abcdefghijklmnopqrstuvwxyz"))  # 28 tokens > 20
        drv.find_element(By.CSS_SELECTOR, "button[data-role=submit]").click()
        status = drv.find_element(By.CSS_SELECTOR, "[data-role=status]")
        WebDriverWait(drv, 30).until(lambda d: status.get_attribute("data-error") == "1")
        assert status.text == "input has 28 tokens; the limit is 20 (restart with a larger --max-tokens)"
        assert all("413" in e for e in errors(drv))  # the refused request is the only error
        drv.execute_script("arguments[0].value = 'x'.repeat(301)", area)  # past the textarea's maxlength
        drv.find_element(By.CSS_SELECTOR, "button[data-role=submit]").click()
        assert status.text == "Input has 301 characters; the limit is 300."
        assert root.is_displayed()  # the last good view stays
        assert json.loads(drv.execute_script("return JSON.stringify(arguments[0].mixlens.state())", root))["n"] == n
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)
