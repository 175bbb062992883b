/* mixlens local viewer: posts the typed text to /api/analyze (same origin only) and mounts the report view.
   Inlined after report.js inside one IIFE; defines no globals. */
function mlxViewer(box, limits) {
  "use strict";
  var doc = box.ownerDocument, count = 0;
  var form = doc.createElement("form"), area = doc.createElement("textarea"), btn = doc.createElement("button");
  var status = doc.createElement("p"), out = doc.createElement("div");
  area.rows = 3; area.cols = 90; area.maxLength = limits.max_chars; area.setAttribute("data-role", "text");
  area.placeholder = "Type a sentence (up to " + limits.max_chars + " characters, " + limits.max_tokens + " tokens)";
  btn.type = "submit"; btn.textContent = "Analyse"; btn.setAttribute("data-role", "submit");
  status.className = "mlx-status"; status.setAttribute("data-role", "status");
  form.appendChild(area); form.appendChild(doc.createElement("br")); form.appendChild(btn);
  box.appendChild(form); box.appendChild(status); box.appendChild(out);
  function say(text, bad) { status.textContent = text; status.setAttribute("data-error", bad ? "1" : "0"); }
  form.addEventListener("submit", function (ev) {
    ev.preventDefault();
    var text = area.value;
    if (!text.trim()) { say("Type a sentence first.", true); return; }
    if (text.length > limits.max_chars) {
      say("Input has " + text.length + " characters; the limit is " + limits.max_chars + ".", true); return;
    }
    btn.disabled = true; say("Analysing\u2026", false);
    fetch("/api/analyze", { method: "POST", headers: { "Content-Type": "application/json" },
                            body: JSON.stringify({ text: text }) })
      .then(function (r) { return r.json().then(function (j) { return { ok: r.ok, body: j }; }); })
      .then(function (res) {
        if (!res.ok) { say(res.body.error || "The server refused the request.", true); return; }
        out.textContent = "";
        var root = doc.createElement("div");
        root.className = "mlx-report"; root.id = "mlx-live-" + (++count);
        out.appendChild(root);
        mlxMount(root, res.body);
        say("Done: " + res.body.inputs[0].tokens.length + " tokens.", false);
      })
      .catch(function (e) { say("Request failed: " + e.message, true); })
      .then(function () { btn.disabled = false; });
  });
}
