/* mixlens report view. Inlined inside an IIFE by mixlens.viz.html: defines no globals and fetches nothing.
   mlxMount(root, data) builds the view inside `root` from the payload of mixlens.viz.html.build_payload and
   exposes `root.mixlens` (state, cell values, geometry) for tests and notebooks. */
function mlxMount(root, data) {
  "use strict";
  var doc = root.ownerDocument;
  var dpr = (doc.defaultView && doc.defaultView.devicePixelRatio) || 1;
  var RATIO_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"];
  var S = { input: 0, method: data.start_method || 0, layer: 0, head: -1, extra: {}, map: null, n: 0, vmin: 0, vmax: 1, geo: null,
            bip: null, focus: -1 };

  function el(tag, cls, text, parent) {
    var e = doc.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function num(v) { return v === null ? NaN : v === "inf" ? Infinity : v === "-inf" ? -Infinity : v; }  // see _flat
  function fmt(v) {
    if (v !== v) return "nan";
    if (!isFinite(v)) return v > 0 ? "inf" : "-inf";
    if (v === 0) return "0";
    var a = Math.abs(v);
    return (a >= 1e4 || a < 1e-3) ? v.toExponential(3) : v.toPrecision(4);
  }
  function option(sel, value, label) { var o = el("option", null, label, sel); o.value = String(value); return o; }
  function control(label, role, parent) {
    var l = el("label", null, label + " ", parent);
    var s = el("select", null, null, l);
    s.setAttribute("data-role", role);
    return { label: l, select: s };
  }
  function setupCanvas(c, w, h) {
    c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
    c.style.width = w + "px"; c.style.height = h + "px";
    var ctx = c.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return ctx;
  }
  function short(t, k) { return t.length > k ? t.slice(0, k - 1) + "\u2026" : t; }

  /* ---- skeleton ---- */
  root.textContent = "";
  el("h2", null, data.title || "mixlens report", root);
  el("p", "mlx-meta", "model: " + data.model + " \u00b7 mixlens " + data.version + " \u00b7 " + data.precision, root);
  if (data.notes && data.notes.length) {
    var ul = el("ul", "mlx-notes", null, root);
    ul.setAttribute("data-role", "notes");
    data.notes.forEach(function (t) { el("li", null, t, ul); });
  }
  var controls = el("div", "mlx-controls", null, root);
  var cInput = control("Input", "input", controls);
  var cMethod = control("Method", "method", controls);
  var cLayer = control("Layer", "layer", controls);
  var cHead = control("Head", "head", controls);
  var extraBox = el("span", null, null, controls);
  var textLine = el("p", "mlx-text", null, root);
  var row = el("div", "mlx-row", null, root);

  var hmCard = el("div", "mlx-card", null, row);
  var hmTitle = el("h3", null, "Token \u00d7 token map", hmCard);
  el("p", "mlx-sub", "rows: target i (explained token) \u00b7 columns: source j (contributing token) \u00b7 hover a cell",
     hmCard);
  var hmCanvas = el("canvas", null, null, hmCard), pixels = doc.createElement("canvas");
  hmCanvas.setAttribute("data-role", "heatmap");
  var cbar = el("div", "mlx-cbar", null, hmCard);
  var cbMin = el("span", null, "", cbar);
  var cbCanvas = el("canvas", null, null, cbar);
  var cbMax = el("span", null, "", cbar);
  var hmNote = el("p", "mlx-sub", "", hmCard);

  var bpCard = el("div", "mlx-card", null, row);
  el("h3", null, "Token \u2192 token links", bpCard);
  el("p", "mlx-sub", "left: source j \u00b7 right: target i \u00b7 width and opacity \u221d value \u00b7 hover a token",
     bpCard);
  var bpCanvas = el("canvas", null, null, bpCard);
  bpCanvas.setAttribute("data-role", "bipartite");
  var bpNote = el("p", "mlx-sub", "", bpCard);

  var rtCard = el("div", "mlx-card", null, root);
  rtCard.style.marginTop = "12px";
  rtCard.setAttribute("data-role", "ratio-card");
  if (!data.inputs.some(function (inp) { return inp.ratios; })) rtCard.style.display = "none";  // no method gives one
  el("h3", null, "Context-mixing ratio per layer (Kobayashi et al. 2021)", rtCard);
  el("p", "mlx-sub", "r = \u2016\u03a3_{j\u2260i} v_ij\u2016 / (\u2016\u03a3_{j\u2260i} v_ij\u2016 + \u2016v_ii\u2016), " +
     "mean over the input's tokens \u00b7 hover the chart", rtCard);
  var rtCanvas = el("canvas", null, null, rtCard);
  rtCanvas.setAttribute("data-role", "ratio");
  var legend = el("div", "mlx-legend", null, rtCard);
  var tip = el("div", "mlx-tip", null, root);
  [hmCanvas, bpCanvas, rtCanvas].forEach(function (c) { c.setAttribute("role", "img"); });
  rtCanvas.setAttribute("aria-label", "context-mixing ratio per layer, one line per variant (values in the legend)");

  if (data.inputs.length < 2) cInput.label.style.display = "none";
  data.inputs.forEach(function (inp, b) { option(cInput.select, b, (b + 1) + ": " + short(inp.text, 40)); });
  data.methods.forEach(function (m, k) { option(cMethod.select, k, m.name); });
  if (!(S.method >= 0 && S.method < data.methods.length)) S.method = 0;
  cMethod.select.value = String(S.method);  /* the selector shows the method the map opens on (start_method) */
  cInput.select.value = String(S.input);
  if (!data.methods.length) {
    controls.style.display = "none";
    row.textContent = "";
    el("p", "mlx-empty", "No token \u00d7 token maps to show (see the notes, or the per-token scores below).", row);
  }

  /* ---- state → current map ---- */
  function method() { return data.methods[S.method]; }
  function axisIndex(a) {
    var v = a.name === "layer" ? S.layer : (S.extra[a.name] || 0);
    return Math.max(0, Math.min(a.size - 1, v));
  }
  function computeMap() {
    var m = method(), n = data.inputs[S.input].tokens.length, lead = 0;
    m.axes.forEach(function (a) { lead = lead * a.size + axisIndex(a); });
    var arr;
    if (S.head >= 0 && m.head_values) { arr = m.head_values[S.input]; lead = lead * m.heads + S.head; }
    else arr = m.values[S.input];
    S.n = n;
    S.map = arr.slice(lead * n * n, (lead + 1) * n * n).map(num);
    var lo = Infinity, hi = -Infinity;
    S.bad = 0;  // NaN and ±inf cells: drawn in their own colour, left out of the scale
    for (var k = 0; k < S.map.length; k++) {
      var v = S.map[k];
      if (!isFinite(v)) { S.bad++; continue; }
      if (v < lo) lo = v; if (v > hi) hi = v;
    }
    if (lo > hi) { lo = 0; hi = 0; }
    if (m.signed) { var a = Math.max(Math.abs(lo), Math.abs(hi)) || 1; S.vmin = -a; S.vmax = a; }
    else { S.vmin = Math.min(0, lo); S.vmax = hi > S.vmin ? hi : S.vmin + 1; }
  }
  var RGB = {};
  Object.keys(data.cmaps).forEach(function (k) {
    RGB[k] = data.cmaps[k].map(function (h) {
      return [parseInt(h.slice(1, 3), 16), parseInt(h.slice(3, 5), 16), parseInt(h.slice(5, 7), 16)];
    });
  });
  function cindex(v) {
    var t = (v - S.vmin) / (S.vmax - S.vmin);
    return Math.max(0, Math.min(255, Math.round(t * 255)));
  }
  var BAD = data.nonfinite || "#ff00ff";
  var BAD_RGB = [parseInt(BAD.slice(1, 3), 16), parseInt(BAD.slice(3, 5), 16), parseInt(BAD.slice(5, 7), 16)];
  function rgbOf(v) { return isFinite(v) ? RGB[method().signed ? "diverging" : "sequential"][cindex(v)] : BAD_RGB; }
  function color(v) { return data.cmaps[method().signed ? "diverging" : "sequential"][cindex(v)]; }

  function fillControls() {
    var m = method(), layerAxis = null;
    m.axes.forEach(function (a) { if (a.name === "layer") layerAxis = a; });
    cLayer.select.textContent = "";
    if (layerAxis) {
      for (var l = 0; l < layerAxis.size; l++) option(cLayer.select, l, String(l));
      S.layer = Math.min(S.layer, layerAxis.size - 1);
      cLayer.select.value = String(S.layer);
      cLayer.select.disabled = false;
    } else { option(cLayer.select, 0, "\u2014"); cLayer.select.disabled = true; }
    cHead.select.textContent = "";
    option(cHead.select, -1, m.all_label);
    if (m.head_values) for (var h = 0; h < m.heads; h++) option(cHead.select, h, String(h));
    if (!m.head_values) S.head = -1;
    S.head = Math.min(S.head, m.heads - 1);
    cHead.select.value = String(S.head);
    cHead.select.disabled = !m.head_values;
    extraBox.textContent = "";
    m.axes.forEach(function (a) {
      if (a.name === "layer") return;
      var c = control(a.name, "axis-" + a.name, extraBox);
      for (var k = 0; k < a.size; k++) option(c.select, k, a.labels ? a.labels[k] : String(k));
      c.select.value = String(axisIndex(a));
      c.select.addEventListener("change", function () { S.extra[a.name] = +c.select.value; render(); });
    });
  }

  /* ---- heatmap ---- */
  function drawHeatmap() {
    var toks = data.inputs[S.input].tokens, n = S.n;
    var cell = Math.max(3, Math.min(28, Math.floor(620 / Math.max(n, 1))));
    var labels = cell >= 7, font = Math.min(12, cell - 1);
    var ctx = hmCanvas.getContext("2d"), lab = 0;
    if (labels) {
      ctx.font = font + "px sans-serif";
      toks.forEach(function (t) { lab = Math.max(lab, ctx.measureText(short(t, 14)).width); });
      lab = Math.ceil(lab) + 6;
    } else lab = 4;
    var w = lab + n * cell + 2, h = lab + n * cell + 2;
    ctx = setupCanvas(hmCanvas, w, h);
    var img = ctx.createImageData(n, n), px = img.data;  // one pixel per cell, scaled up unsmoothed
    for (var k = 0; k < n * n; k++) {
      var rgb = rgbOf(S.map[k]);
      px[4 * k] = rgb[0]; px[4 * k + 1] = rgb[1]; px[4 * k + 2] = rgb[2]; px[4 * k + 3] = 255;
    }
    pixels.width = n; pixels.height = n;
    pixels.getContext("2d").putImageData(img, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(pixels, lab, lab, n * cell, n * cell);
    var i, j;
    if (labels) {
      ctx.fillStyle = "#222"; ctx.font = font + "px sans-serif"; ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      for (i = 0; i < n; i++) ctx.fillText(short(toks[i], 14), lab - 4, lab + (i + 0.5) * cell);
      ctx.save(); ctx.rotate(-Math.PI / 2); ctx.textAlign = "left";
      for (j = 0; j < n; j++) ctx.fillText(short(toks[j], 14), -lab + 4, lab + (j + 0.5) * cell);
      ctx.restore();
    }
    S.geo = { left: lab, top: lab, cell: cell, width: w, height: h };
    var m = method();
    hmTitle.textContent = "Token \u00d7 token map \u2014 " + m.name + describe();
    hmCanvas.setAttribute("aria-label", hmTitle.textContent + "; " + n + " tokens");
    bpCanvas.setAttribute("aria-label", "links between tokens for " + m.name + describe());
    hmNote.textContent = (labels ? "" : n + " tokens: labels hidden at this size; hover a cell for its tokens. ") +
      (S.bad ? S.bad + " cell" + (S.bad > 1 ? "s are" : " is") + " NaN or \u00b1inf (magenta; hover for the value)." : "");
    hmNote.setAttribute("data-nonfinite", String(S.bad));
    var cc = setupCanvas(cbCanvas, 160, 10);
    for (var x = 0; x < 160; x++) { cc.fillStyle = color(S.vmin + (S.vmax - S.vmin) * x / 159); cc.fillRect(x, 0, 1, 10); }
    cbMin.textContent = fmt(S.vmin); cbMax.textContent = fmt(S.vmax);
  }
  function describe() {
    var m = method(), parts = [];
    m.axes.forEach(function (a) { parts.push(a.name + " " + axisIndex(a)); });
    if (m.heads || m.head_values) parts.push(S.head >= 0 ? "head " + S.head : m.all_label);
    return parts.length ? " (" + parts.join(", ") + ")" : "";
  }

  /* ---- bipartite ---- */
  function drawBipartite() {
    var toks = data.inputs[S.input].tokens, n = S.n, map = S.map, maxLinks = data.max_links || 3000;
    var rowH = Math.max(7, Math.min(18, Math.floor(640 / Math.max(n, 1))));  // labels stay legible
    var font = Math.min(12, rowH - 1), ctx = bpCanvas.getContext("2d"), lab = 0, labels = rowH >= 7;
    if (labels) {
      ctx.font = font + "px sans-serif";
      toks.forEach(function (t) { lab = Math.max(lab, ctx.measureText(short(t, 14)).width); });
    }
    lab = Math.ceil(lab) + 8;
    var gap = 170, w = 2 * lab + gap, h = n * rowH + 8, x0 = lab, x1 = lab + gap;
    ctx = setupCanvas(bpCanvas, w, h);
    var abs = Float64Array.from(map.filter(isFinite), Math.abs).sort(), amax = abs[abs.length - 1] || 0, k, order = [];
    var total = 0;
    for (k = 0; k < abs.length; k++) if (abs[k] > 0) total++;
    var cut = (S.focus < 0 && total > maxLinks) ? abs[abs.length - maxLinks] : 0;  // keep the strongest links
    for (k = 0; k < map.length; k++) if (map[k] !== 0 && isFinite(map[k]) && Math.abs(map[k]) >= cut) order.push(k);
    function y(i) { return 4 + (i + 0.5) * rowH; }
    var buckets = {}, drawn = 0;  // links grouped by colour and strength: one stroke per group
    for (var q = 0; q < order.length; q++) {
      k = order[q];
      var i = Math.floor(k / n), j = k % n;
      if (S.focus >= 0 && i !== S.focus && j !== S.focus) continue;
      var t = amax ? Math.abs(map[k]) / amax : 0;
      if (t < 0.005) continue;
      var key = (map[k] < 0 ? -1 : 1) * (1 + Math.round(t * 19));
      (buckets[key] = buckets[key] || []).push(j, i);
      drawn++;
    }
    Object.keys(buckets).map(Number).sort(function (a, b) { return Math.abs(a) - Math.abs(b); }).forEach(function (key) {
      var t = (Math.abs(key) - 1) / 19, seg = buckets[key];
      ctx.strokeStyle = key < 0 ? "rgba(33,102,172," + (0.1 + 0.9 * t) + ")" : "rgba(178,24,43," + (0.1 + 0.9 * t) + ")";
      ctx.lineWidth = 0.3 + 3.5 * t;
      ctx.beginPath();
      for (var s2 = 0; s2 < seg.length; s2 += 2) { ctx.moveTo(x0 + 2, y(seg[s2])); ctx.lineTo(x1 - 2, y(seg[s2 + 1])); }
      ctx.stroke();
    });
    if (labels) {
      ctx.font = font + "px sans-serif"; ctx.textBaseline = "middle";
      for (var r = 0; r < n; r++) {
        ctx.fillStyle = r === S.focus ? "#d00" : "#222";
        ctx.textAlign = "right"; ctx.fillText(short(toks[r], 14), x0 - 4, y(r));
        ctx.textAlign = "left"; ctx.fillText(short(toks[r], 14), x1 + 4, y(r));
      }
    }
    S.bip = { x0: x0, x1: x1, rowH: rowH, top: 4, width: w };
    bpNote.textContent = (S.focus < 0 && total > maxLinks ? "showing the " + maxLinks + " strongest of " + total +
      " links; " : "") + drawn + " links drawn (links under 0.5% of the largest are hidden)" +
      (labels ? "" : "; labels hidden at this size, hover a row");
  }

  /* ---- ratio chart ---- */
  function drawRatios() {
    var rat = ratiosOf(S.input);
    legend.textContent = "";
    if (!rat) { setupCanvas(rtCanvas, 10, 10); el("span", "mlx-empty", "No mixing ratios in this result.", legend); return; }
    var names = Object.keys(rat), L = rat[names[0]].length;
    var w = 620, h = 260, l = 44, r = 12, t = 10, b = 34, ctx = setupCanvas(rtCanvas, w, h);
    function X(k) { return l + (L > 1 ? k / (L - 1) : 0.5) * (w - l - r); }
    function Y(v) { return t + (1 - v) * (h - t - b); }
    ctx.strokeStyle = "#ddd"; ctx.fillStyle = "#444"; ctx.font = "11px sans-serif"; ctx.lineWidth = 1;
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (var g = 0; g <= 5; g++) {
      var v = g / 5;
      ctx.beginPath(); ctx.moveTo(l, Y(v)); ctx.lineTo(w - r, Y(v)); ctx.stroke();
      ctx.fillText(Math.round(v * 100) + "%", l - 4, Y(v));
    }
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (var k = 0; k < L; k++) ctx.fillText(String(k), X(k), h - b + 4);
    ctx.fillText("layer", (l + w - r) / 2, h - 14);
    names.forEach(function (name, c) {
      var col = RATIO_COLORS[c % RATIO_COLORS.length];
      ctx.strokeStyle = col; ctx.fillStyle = col; ctx.lineWidth = 2;
      ctx.beginPath();
      var up = false;  // a NaN or ±inf layer breaks the line and is marked at the bottom of the chart
      rat[name].forEach(function (v, k) {
        if (!isFinite(v)) { up = false; return; }
        if (up) ctx.lineTo(X(k), Y(v)); else ctx.moveTo(X(k), Y(v));
        up = true;
      });
      ctx.stroke();
      rat[name].forEach(function (v, k) {
        if (!isFinite(v)) { ctx.fillStyle = BAD; ctx.fillText(fmt(v), X(k), h - b - 12); ctx.fillStyle = col; return; }
        ctx.beginPath(); ctx.arc(X(k), Y(v), 3, 0, 2 * Math.PI); ctx.fill();
      });
      var item = el("span", null, null, legend);
      el("span", "mlx-sw", null, item).style.background = col;
      var fin = rat[name].filter(isFinite), bad = rat[name].length - fin.length;
      item.appendChild(doc.createTextNode(name + " (mean " + (100 * mean(fin)).toFixed(1) + "%" +
        (bad ? "; " + bad + " layer" + (bad > 1 ? "s" : "") + " NaN or \u00b1inf" : "") + ")"));
    });
    S.rt = { X: X, L: L, names: names };
  }
  function mean(a) { var s = 0; a.forEach(function (v) { s += v; }); return a.length ? s / a.length : 0; }
  function ratiosOf(b) {
    var r = data.inputs[b].ratios, out = {};
    if (!r) return null;
    Object.keys(r).forEach(function (k) { out[k] = r[k].map(num); });
    return out;
  }

  /* ---- tooltip ---- */
  function showTip(ev, text) {
    var rb = root.getBoundingClientRect();
    tip.textContent = text; tip.style.display = "block";
    tip.style.left = (ev.clientX - rb.left + 14) + "px"; tip.style.top = (ev.clientY - rb.top + 14) + "px";
  }
  function hideTip() { tip.style.display = "none"; }
  function local(ev, c) { var b = c.getBoundingClientRect(); return [ev.clientX - b.left, ev.clientY - b.top]; }

  hmCanvas.addEventListener("mousemove", function (ev) {
    var p = local(ev, hmCanvas), g = S.geo;
    var j = Math.floor((p[0] - g.left) / g.cell), i = Math.floor((p[1] - g.top) / g.cell);
    if (i < 0 || j < 0 || i >= S.n || j >= S.n) { hideTip(); return; }
    var toks = data.inputs[S.input].tokens;
    showTip(ev, "target " + i + " \u201c" + toks[i] + "\u201d \u2190 source " + j + " \u201c" + toks[j] + "\u201d\n" +
            method().name + ": " + fmt(S.map[i * S.n + j]));
  });
  hmCanvas.addEventListener("mouseleave", hideTip);
  bpCanvas.addEventListener("mousemove", function (ev) {
    var p = local(ev, bpCanvas), g = S.bip, i = Math.floor((p[1] - g.top) / g.rowH);
    var side = p[0] < g.x0 + 20 ? "source" : (p[0] > g.x1 - 20 ? "target" : null);
    if (i < 0 || i >= S.n || !side) { hideTip(); if (S.focus >= 0) { S.focus = -1; drawBipartite(); } return; }
    if (S.focus !== i) { S.focus = i; drawBipartite(); }
    var toks = data.inputs[S.input].tokens, best = -1, bv = -Infinity;
    for (var k = 0; k < S.n; k++) {
      var v = side === "target" ? S.map[i * S.n + k] : S.map[k * S.n + i];
      if (Math.abs(v) > bv) { bv = Math.abs(v); best = k; }
    }
    var v2 = side === "target" ? S.map[i * S.n + best] : S.map[best * S.n + i];
    showTip(ev, side + " " + i + " \u201c" + toks[i] + "\u201d\nstrongest " + (side === "target" ? "source " : "target ") +
            best + " \u201c" + toks[best] + "\u201d: " + fmt(v2));
  });
  bpCanvas.addEventListener("mouseleave", function () { hideTip(); if (S.focus >= 0) { S.focus = -1; drawBipartite(); } });
  rtCanvas.addEventListener("mousemove", function (ev) {
    if (!S.rt) return;
    var p = local(ev, rtCanvas), best = 0, rat = ratiosOf(S.input);
    if (!rat) return;
    for (var k = 1; k < S.rt.L; k++) if (Math.abs(S.rt.X(k) - p[0]) < Math.abs(S.rt.X(best) - p[0])) best = k;
    showTip(ev, "layer " + best + "\n" + S.rt.names.map(function (nm) {
      var v = rat[nm][best]; return nm + ": " + (isFinite(v) ? (100 * v).toFixed(1) + "%" : fmt(v)); }).join("\n"));
  });
  rtCanvas.addEventListener("mouseleave", hideTip);

  /* ---- wiring ---- */
  function render() {
    S.focus = -1;
    textLine.textContent = data.inputs[S.input].text;
    if (data.methods.length) { computeMap(); drawHeatmap(); drawBipartite(); }
    drawRatios();
    root.setAttribute("data-input", S.input);
    root.setAttribute("data-method", data.methods.length ? method().name : "");
    root.setAttribute("data-layer", S.layer);
    root.setAttribute("data-head", S.head);
    root.setAttribute("data-ready", "1");
  }
  cInput.select.addEventListener("change", function () { S.input = +cInput.select.value; render(); });
  cMethod.select.addEventListener("change", function () { S.method = +cMethod.select.value; fillControls(); render(); });
  cLayer.select.addEventListener("change", function () { S.layer = +cLayer.select.value; render(); });
  cHead.select.addEventListener("change", function () { S.head = +cHead.select.value; render(); });

  root.mixlens = {
    state: function () {
      return { input: S.input, method: data.methods.length ? method().name : null, layer: S.layer, head: S.head,
               n: S.n, vmin: S.vmin, vmax: S.vmax };
    },
    cell: function (i, j) { return S.map[i * S.n + j]; },
    map: function () { return Array.prototype.slice.call(S.map); },
    geometry: function () { return { heatmap: S.geo, bipartite: S.bip }; }
  };
  if (data.methods.length) fillControls();
  render();
}
