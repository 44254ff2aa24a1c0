"""The HTML page of the report: one file, inline style, script and data, no network.

Placeholders: %%TITLE%%, %%DATA%% (JSON, with "</" escaped), %%FIGURES%% (<figure>s).
Element ids the browser test drives: #layer, #head, #mode (selects), .ltok[data-i]
(query tokens, click to pick / unpick), line.edge[data-i][data-j][data-w], #readout,
#headinfo, #heat (the selected head's matrix).
"""

PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>%%TITLE%%</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 1200px; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
.controls label { margin-right: 1.2em; } select { font-size: 14px; }
#readout { margin: .6em 0; font-family: ui-monospace, monospace; min-height: 1.4em; }
.row { display: flex; gap: 2em; align-items: flex-start; flex-wrap: wrap; }
svg text { font: 13px ui-monospace, monospace; cursor: pointer; user-select: none; }
svg text.sel { font-weight: bold; fill: #c00; }
svg text.sink { fill: #777; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
.muted { color: #777; }
</style></head>
<body>
<h1>%%TITLE%%</h1>
<p class="muted" id="about"></p>
<div class="controls">
  <label>Layer <select id="layer"></select></label>
  <label>Head <select id="head"></select></label>
  <label>Show <select id="mode"><option value="pattern">attention weights a_ij</option>
    <option value="norms">value-weighted norms ||a_ij f(x_j)|| (row-normalized)</option>
    <option value="rollout">attention rollout through all layers (layer/head ignored)</option></select></label>
  <span class="muted">click a token on the left to pick it (again to unpick)</span>
</div>
<div id="readout"></div>
<div class="row">
  <svg id="flow" width="420" height="100"></svg>
  <svg id="heat" width="420" height="420"></svg>
  <div id="headinfo"></div>
</div>
<h2>Summary</h2>
<div id="summary"></div>
<h2>Figures</h2>
%%FIGURES%%
<script id="data" type="application/json">%%DATA%%</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const V = D.view, T = V.tokens.length, L = V.pattern.length;
const state = { layer: 0, head: "0", token: null, mode: "pattern" };
const $ = (id) => document.getElementById(id);
const NS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function matrix() {   // T x T for the current layer / head / mode; "mean" averages the heads
  if (state.mode === "rollout") return V.rollout;
  const heads = V[state.mode][state.layer];
  if (state.head !== "mean") return heads[+state.head];
  return heads[0].map((row, i) => row.map((_, j) => heads.reduce((s, h) => s + h[i][j], 0) / heads.length));
}
function color(v) {   // white -> dark blue
  const t = Math.max(0, Math.min(1, v));
  const c = (a, b) => Math.round(a + (b - a) * t);
  return `rgb(${c(255, 8)},${c(255, 48)},${c(255, 107)})`;
}
function fillHeads() {
  const sel = $("head"), n = V.pattern[state.layer].length;
  sel.innerHTML = "";
  for (let h = 0; h < n; h++) sel.add(new Option(String(h), String(h)));
  sel.add(new Option("all (mean)", "mean"));
  if (state.head !== "mean" && +state.head >= n) state.head = "0";
  sel.value = state.head;
}
function drawFlow(m) {
  const svg = $("flow"), rowH = 22, x0 = 150, x1 = 270;
  svg.innerHTML = "";
  svg.setAttribute("height", String(T * rowH + 10));
  for (let i = 0; i < T; i++) {
    for (let j = 0; j < T; j++) {
      const w = m[i][j];
      if (state.token !== null && i !== state.token) continue;
      if (w < 0.01) continue;
      svg.appendChild(svgEl("line", { class: "edge", "data-i": i, "data-j": j, "data-w": w.toFixed(6),
        x1: x0, y1: 16 + i * rowH, x2: x1, y2: 16 + j * rowH, stroke: "#1f5fbf",
        "stroke-width": 1 + 3 * w, "stroke-opacity": Math.min(1, state.token === null ? w : 0.15 + 0.85 * w) }));
    }
  }
  V.tokens.forEach((tok, i) => {
    const cls = ["ltok"]; if (i === state.token) cls.push("sel"); if (V.sinks[i]) cls.push("sink");
    const t = svgEl("text", { class: cls.join(" "), "data-i": i, x: x0 - 8, y: 20 + i * rowH, "text-anchor": "end" }, tok);
    t.addEventListener("click", () => { state.token = state.token === i ? null : i; render(); });
    svg.appendChild(t);
    const r = svgEl("text", { class: "rtok" + (V.sinks[i] ? " sink" : ""), "data-j": i, x: x1 + 8, y: 20 + i * rowH }, tok);
    if (state.token !== null) r.setAttribute("font-weight", m[state.token][i] >= 0.1 ? "bold" : "normal");
    svg.appendChild(r);
  });
}
function drawHeat(m) {
  const svg = $("heat"), pad = 110, cell = Math.max(6, Math.min(26, Math.floor(300 / T)));
  svg.innerHTML = "";
  svg.setAttribute("width", String(pad + T * cell + 10));
  svg.setAttribute("height", String(pad + T * cell + 10));
  for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
    const r = svgEl("rect", { x: pad + j * cell, y: pad + i * cell, width: cell, height: cell, fill: color(m[i][j]),
      stroke: i === state.token ? "#c00" : "none", "data-i": i, "data-j": j });
    r.appendChild(svgEl("title", {}, `${V.tokens[i]} -> ${V.tokens[j]}: ${m[i][j].toFixed(3)}`));
    svg.appendChild(r);
  }
  V.tokens.forEach((tok, i) => {
    svg.appendChild(svgEl("text", { x: pad - 4, y: pad + i * cell + cell * 0.7, "text-anchor": "end", "font-size": 11 }, tok));
    svg.appendChild(svgEl("text", { x: 0, y: 0, "font-size": 11,
      transform: `translate(${pad + j0(i, cell)}, ${pad - 4}) rotate(-60)` }, tok));
  });
}
function j0(i, cell) { return i * cell + cell * 0.6; }
function fmt(x, d = 3) { return x === null || x === undefined ? "-" : (+x).toFixed(d); }
function headInfo() {
  const box = $("headinfo");
  if (state.head === "mean" || !D.roles) { box.innerHTML = ""; return; }
  const l = state.layer, h = +state.head, r = D.roles.heads[l][h];
  let rows = Object.entries(r.scores).map(([k, v]) =>
    `<tr><td>${k}${k === "offset" ? " (k=" + r.offset_k + ")" : ""}</td><td>${fmt(v)}</td><td>${fmt(D.roles.thresholds[k], 2)}</td></tr>`).join("");
  const imp = D.importance ? D.importance.normalized[l][h] : null;
  const hint = D.hints ? D.hints.ratio[l][h] : null;
  box.innerHTML = `<b>layer ${l} head ${h}</b><br>labels: <span id="labels">${r.labels.join(", ") || "none"}</span>
    <table><tr><th>role</th><th>score</th><th>label at</th></tr>${rows}</table>
    mean distance: ${fmt(r.mean_distance, 1)} tokens<br>importance (layer-normalized): ${fmt(imp)}<br>
    top-token norm share / weight: ${fmt(hint, 2)}${D.hints && D.hints.flagged[l][h] ? " <b>(hint, not explanation)</b>" : ""}`;
}
function readout(m) {
  const where = state.mode === "rollout" ? "rollout" :
    `layer ${state.layer}, head ${state.head === "mean" ? "mean" : state.head}, ${state.mode === "pattern" ? "weights" : "norms"}`;
  if (state.token === null) { $("readout").textContent = `${where}: pick a token`; return; }
  const row = m[state.token];
  let best = 0; row.forEach((w, j) => { if (w > row[best]) best = j; });
  $("readout").textContent = `${where}: "${V.tokens[state.token]}" (${state.token}) -> "${V.tokens[best]}" (${best}) ${row[best].toFixed(3)}`;
}
function render() {
  const m = matrix();
  drawFlow(m); drawHeat(m); headInfo(); readout(m);
}
function summary() {
  const s = D.summary || {}, out = [];
  if (s.ablation && s.ablation.removable) {
    for (const [key, per] of Object.entries(s.ablation.removable)) {
      const orders = Object.keys(per["1%"]);
      out.push(`<p>Largest fraction of heads removed with quality drop (${key}) at most 1% / 5%:</p><table><tr><th>order</th>` +
        Object.keys(per).map((t) => `<th>${t}</th>`).join("") + "</tr>" +
        orders.map((o) => `<tr><td>${o}</td>` + Object.keys(per).map((t) => `<td>${fmt(per[t][o], 3)}</td>`).join("") + "</tr>").join("") + "</table>");
    }
  }
  if (s.pruning) {
    const p = s.pruning, lat = p.latency;
    out.push(`<p>Pruned ${p.heads_removed} heads (${(100 * p.fraction).toFixed(0)}%) for real: parameters ${p.params_before.toLocaleString()} -> ${p.params_after.toLocaleString()},
      CPU latency (median, batch ${p.latency_batch.join("x")}) ${(1e3 * lat.full.median).toFixed(1)} ms -> ${(1e3 * lat.pruned.median).toFixed(1)} ms,
      quality drop ${(100 * p.drop_after).toFixed(2)}%.</p>`);
  }
  if (s.layer_types) out.push(layerTypes(s.layer_types));
  if (s.patching) out.push(patchingTable(s.patching));
  if (s.long_context) out.push(longContext(s.long_context));
  if (s.corpus) out.push(`<p class="muted">Corpus: ${s.corpus.source}; fit ${s.corpus.fit_tokens} tokens, held out ${s.corpus.heldout_tokens} tokens.</p>`);
  $("summary").innerHTML = out.join("");
}
function layerTypes(groups) {   // roles per layer type: local (sliding window) vs global layers
  const roles = Object.keys(groups[0].role_share);
  const rows = groups.map((g) => `<tr><td>${esc(g.type)}</td><td>${g.window === null ? "-" : g.window}</td>` +
    `<td>${g.layers.join(",")}</td><td>${g.heads}</td>` + roles.map((r) => `<td>${g.role_counts[r]}</td>`).join("") +
    `<td>${g.mean_importance === undefined ? "-" : fmt(g.mean_importance, 3)}</td></tr>`).join("");
  return `<p id="layer-types">Roles by layer type (heads carrying each label; local layers see a sliding window of keys,
    see roles_by_layer_type.png):</p><table><tr><th>type</th><th>window</th><th>layers</th><th>heads</th>` +
    roles.map((r) => `<th>${esc(r)}</th>`).join("") + `<th>mean importance</th></tr>${rows}</table>`;
}
function patchingTable(p) {   // activation patching: per pair, the metric and the heads that recover most
  const unit = p.metric === "logit_diff" ? "logit difference answer - wrong" : "cosine to the clean embedding";
  const rows = p.pairs.map((r) => `<tr><td>${esc(r.clean)}<br><span class="muted">${esc(r.corrupted)}</span></td>` +
    `<td>${r.answer === null ? "-" : esc(r.answer) + " / " + esc(r.wrong)}</td><td>${fmt(r.metric_clean, 2)}</td>` +
    `<td>${fmt(r.metric_corrupted, 2)}</td><td>${fmt(r.all_heads_recovered, 2)}</td>` +
    `<td>${r.top.slice(0, 3).map((t) => `L${t.layer}H${t.head} ${fmt(t.value, 2)}`).join(", ")}</td>` +
    `<td>${r.dla_total === undefined ? "-" : fmt(r.dla_total, 2) + " / " + fmt(r.dla_logit, 2)}</td></tr>`).join("");
  const skipped = p.skipped.map((s) => `<li>${esc(s.clean)}: ${esc(s.reason)}</li>`).join("");
  return `<p id="patching">Activation patching (${unit}): each head's clean output put into the corrupted run;
    recovered = (patched - corrupted) / (clean - corrupted).</p><table><tr><th>clean / corrupted prompt</th>
    <th>answer / wrong</th><th>clean</th><th>corrupted</th><th>all heads patched</th><th>heads that recover most</th>
    <th>DLA sum / logit</th></tr>${rows}</table>` + (skipped ? `<p class="muted">Skipped pairs:</p><ul>${skipped}</ul>` : "");
}
// MiB with the one decimal the report's text and JSON carry (JS would print 691.0 as "691")
const mib = (x) => (x == null ? "unknown" : x.toFixed(1));
function longContext(c) {   // the --context step: length, time, peak memory, labels per role
  const counts = {};
  c.labels.flat().flat().forEach((lab) => { const r = lab.startsWith("offset") ? "offset" : lab; counts[r] = (counts[r] || 0) + 1; });
  const labels = Object.entries(counts).map(([r, n]) => `${r} ${n}`).join(", ") || "none";
  const beyond = c.beyond_trained_context ? ` (beyond the trained ${c.trained_context})` : "";
  return `<p id="long-context">Long context: ${c.tokens} tokens${beyond} of ${esc(c.source)}${c.copies > 1 ? ` (text repeated ${c.copies}x)` : ""},
    ${c.seconds.toFixed(0)} s; peak memory ${mib(c.memory.peak_mib)} MiB, ${mib(c.memory.extra_mib)} MiB for the pass
    <span class="muted">(${esc(c.memory.method)})</span>, where the (T, T) patterns would take ${(c.patterns_bytes / 2 ** 30).toFixed(1)} GiB.
    Heads labelled at that length: ${labels} (sinks = the first ${c.sinks} tokens; see long_context.png).</p>`;
}
function esc(s) { return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;"); }
function init() {
  $("about").textContent = `${D.model.name}: ${D.model.layers} layers, heads per layer ${D.model.heads.join(",")}; text: ${V.text}`;
  for (let l = 0; l < L; l++) $("layer").add(new Option(String(l), String(l)));
  $("layer").addEventListener("change", (e) => { state.layer = +e.target.value; fillHeads(); render(); });
  $("head").addEventListener("change", (e) => { state.head = e.target.value; render(); });
  $("mode").addEventListener("change", (e) => { state.mode = e.target.value; render(); });
  fillHeads(); render(); summary();
}
init();
</script>
</body></html>
"""
