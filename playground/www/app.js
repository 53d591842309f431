// The playground page: configurations validated live, traffic generated or pasted, every
// decision made by sluice's core (compiled to WebAssembly), charts, request details, and the
// whole scenario in the URL fragment.

import init, { validate, simulate, version } from "./pkg/sluice_playground.js";
import { generate } from "./traffic.js";
import { lineChart, pointChart, fmtSeconds } from "./plot.js";

const $ = (id) => document.getElementById(id);
const COLORS = { offered: "#94a3b8", admitted: "#16a34a", denied: "#dc2626", shadow: "#d97706", delayed: "#2563eb" };
const KEY_COLORS = ["#2f5bd3", "#16a34a", "#d97706", "#9333ea", "#0891b2", "#db2777", "#65a30d", "#ea580c"];
const STATUS_TEXT = { 200: "OK", 429: "Too Many Requests", 503: "Service Unavailable" };

const rule = (name, limits, extra = {}) => ({ name, key: ["client_ip"], limits, ...extra });
const PRESETS = {
  "Token bucket: 60 a minute, burst 10": { rules: [rule("per-client", [{ requests: 60, per: "minute", burst: 10 }])] },
  "Sliding window: 60 a minute": { rules: [rule("per-client", [{ requests: 60, per: "minute", algorithm: "sliding_window" }])] },
  "Fixed window: 60 a minute": { rules: [rule("per-client", [{ requests: 60, per: "minute", algorithm: "fixed_window" }])] },
  "GCRA: 60 a minute, burst 10": { rules: [rule("per-client", [{ requests: 60, per: "minute", burst: 10, algorithm: "gcra" }])] },
  "Sliding log: 5 a minute (logins)": { rules: [rule("login", [{ requests: 5, per: "minute", algorithm: "sliding_log" }])] },
  "Leaky bucket: 2 a second, queue 10": {
    rules: [rule("smooth", [{ requests: 2, per: "second", algorithm: "leaky_bucket", queue: 10, max_delay_ms: 5000 }])],
  },
  "Two limits: 10 a second and 300 a minute": {
    headers: "both",
    rules: [rule("per-client", [{ requests: 10, per: "second" }, { requests: 300, per: "minute" }])],
  },
  "Per client and for everyone": {
    rules: [
      rule("per-client", [{ requests: 60, per: "minute", burst: 10 }]),
      { name: "everyone", key: ["const:all"], limits: [{ requests: 120, per: "minute" }] },
    ],
  },
  "Monitor first: 30 a minute, counted only": {
    rules: [rule("trial", [{ requests: 30, per: "minute" }], { mode: "monitor" })],
  },
  "Per-customer limit from the token (paste a trace with jwt:rate_per_minute=...)": {
    rules: [{
      name: "contract", key: ["jwt:sub"], limits: [{ requests: 60, per: "minute" }],
      limits_from: { from: "jwt:rate_per_minute", max: 600 },
    }],
  },
};
const PRESET_B = "Sliding window: 60 a minute";
const TRAFFIC_FIELDS = ["pattern", "duration", "rate", "rate-from", "rate-to", "burst-size", "burst-every", "clients", "skew", "path", "seed"];

const pretty = (config) => JSON.stringify(config, null, 2);
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

const view = {
  reports: { a: null, b: null },
  selected: null,
  trace: "",
  runs: 0,
  stateRule: { a: 0, b: 0 },
  stateLimit: { a: 0, b: 0 },
  perRule: { a: 0, b: 0 },
};

// ---------- validation ----------

function check(side) {
  const box = $(`config-${side}`);
  const status = $(`status-${side}`);
  let answer;
  try {
    answer = JSON.parse(validate(box.value));
  } catch (e) {
    answer = { ok: false, field: "", message: `the validator failed: ${e}` };
  }
  box.classList.toggle("invalid", !answer.ok);
  status.className = `status ${answer.ok ? "ok" : "bad"}`;
  if (answer.ok) {
    const n = answer.rules.length;
    status.textContent = `✓ valid: ${n} rule${n === 1 ? "" : "s"} (${answer.rules.map((r) => r.name).join(", ")})`;
  } else {
    status.innerHTML = answer.field
      ? `✗ <span class="field">${esc(answer.field)}</span>: ${esc(answer.problem)}`
      : `✗ ${esc(answer.message)}`;
  }
  status.dataset.field = answer.ok ? "" : answer.field;
  return answer.ok;
}

// ---------- traffic ----------

function traffic() {
  const p = {};
  for (const f of TRAFFIC_FIELDS) p[f] = $(f).value;
  return p;
}

function showPatternFields() {
  const pattern = $("pattern").value;
  for (const el of document.querySelectorAll("[data-for]")) {
    el.hidden = !el.dataset.for.split(" ").includes(pattern);
  }
}

function currentTrace() {
  const p = traffic();
  if (p.pattern === "csv") {
    const count = $("csv").value.split("\n").filter((l) => /^\s*[0-9.]/.test(l)).length;
    return { csv: $("csv").value, count, cut: false };
  }
  return generate({
    pattern: p.pattern, duration: p.duration, rate: p.rate, rateFrom: p["rate-from"], rateTo: p["rate-to"],
    burstSize: p["burst-size"], burstEvery: p["burst-every"], clients: p.clients, skew: p.skew, path: p.path, seed: p.seed,
  });
}

// ---------- running ----------

function sides() {
  return $("compare").checked ? ["a", "b"] : ["a"];
}

function run() {
  const trace = currentTrace();
  view.trace = trace.csv;
  $("trace-out").value = trace.csv;
  $("trace-status").textContent = `${trace.count.toLocaleString("en")} requests${trace.cut ? " (cut at 50,000)" : ""}`;
  const errors = [];
  for (const side of ["a", "b"]) {
    const column = $(`result-${side}`);
    if (!sides().includes(side)) {
      column.hidden = true;
      view.reports[side] = null;
      continue;
    }
    column.hidden = false;
    const config = $(`config-${side}`).value;
    if (!check(side)) {
      view.reports[side] = null;
      column.innerHTML = `<h2><span class="tag tag-${side}">${side.toUpperCase()}</span> Fix the configuration to see its decisions</h2>`;
      continue;
    }
    let report;
    try {
      report = JSON.parse(simulate(config, trace.csv));
    } catch (e) {
      report = { ok: false, message: `the simulation failed: ${e}` };
    }
    if (!report.ok) {
      errors.push(report.message);
      view.reports[side] = null;
      column.innerHTML = "";
      continue;
    }
    view.reports[side] = report;
  }
  $("columns").classList.toggle("two", sides().length === 2);
  $("error").hidden = errors.length === 0;
  $("error").textContent = errors[0] || "";
  const n = (view.reports.a || view.reports.b)?.requests.length || 0;
  if (view.selected == null || view.selected >= n) view.selected = null;
  renderAll();
  view.runs += 1;
  document.body.dataset.runs = String(view.runs);
  saveToUrl();
}

function renderAll() {
  for (const side of sides()) if (view.reports[side]) renderColumn(side);
  renderDetail();
}

// ---------- a column of results ----------

function limitText(l) {
  const burst = l.burst !== l.requests && (l.algorithm === "token_bucket" || l.algorithm === "gcra") ? `, burst ${l.burst}` : "";
  const algo = l.algorithm === "token_bucket" ? "" : ` (${l.algorithm.replace(/_/g, " ")})`;
  return `${l.requests} a ${l.per}${burst}${algo}`;
}

function stat(k, label, value, total) {
  const share = total && k !== "offered" ? `${((100 * value) / total).toFixed(1)}%` : "&nbsp;";
  return `<div class="stat ${k}" data-k="${k}" data-count="${value}"><b>${value.toLocaleString("en")}</b><span>${label}</span><small>${share}</small></div>`;
}

function renderColumn(side) {
  const r = view.reports[side];
  const t = r.totals;
  const column = $(`result-${side}`);
  const xMax = Math.max(r.series.bucket_s * r.series.offered.length, 1);
  const rules = r.rules.map((x) => `<b>${esc(x.name)}</b> ${esc(x.limits.map(limitText).join(" and "))}${x.mode !== "enforce" ? ` (${x.mode})` : ""}`);
  column.innerHTML = `
    <h2><span class="tag tag-${side}">${side.toUpperCase()}</span> ${rules.join(" · ") || "no rules"}</h2>
    ${r.notes.length ? `<ul class="notes">${r.notes.map((n) => `<li>${esc(n)}</li>`).join("")}</ul>` : ""}
    <div class="totals" data-testid="totals">
      ${stat("offered", "offered", t.offered, t.offered)}
      ${stat("admitted", "admitted", t.admitted, t.offered)}
      ${stat("denied", "denied (429)", t.denied, t.offered)}
      ${stat("delayed", "delayed", t.delayed, t.offered)}
      ${stat("unavailable", "503", t.unavailable, t.offered)}
    </div>
    <h3>Requests per ${esc(fmtSeconds(r.series.bucket_s))}</h3><div class="box-over"></div>
    <h3>Per rule</h3>
    <table class="rules"><thead><tr><th>rule</th><th>counted</th><th>allowed</th><th>denied</th><th>would deny</th></tr></thead>
    <tbody>${r.rules.map((x, i) => {
      const rt = t.rules[i];
      return `<tr><td>${esc(x.name)}</td><td>${rt.matched}</td><td>${rt.allowed}</td><td>${rt.denied + rt.unavailable}</td><td>${rt.shadow_denied}</td></tr>`;
    }).join("")}</tbody></table>
    <div class="box-rule"></div>
    <h3>Limit state</h3><div class="box-state"></div>
    <h3>Retry-After of denied requests</h3><div class="box-retry"></div>`;
  const marker = view.selected == null ? null : r.requests[view.selected]?.t;
  const dx = r.series.bucket_s;
  const bucketText = (tt) => {
    const i = Math.min(Math.floor(tt / dx), r.series.offered.length - 1);
    return `${fmtSeconds(i * dx)}–${fmtSeconds((i + 1) * dx)}: offered ${r.series.offered[i]}, admitted ${r.series.admitted[i]}, denied ${r.series.denied[i]}`;
  };
  lineChart(column.querySelector(".box-over"), {
    dx, xMax, marker, yLabel: "requests", describe: bucketText, pick: select,
    series: [
      { label: "offered", color: COLORS.offered, values: r.series.offered, width: 2.2 },
      { label: "admitted", color: COLORS.admitted, values: r.series.admitted },
      { label: "denied", color: COLORS.denied, values: r.series.denied },
    ],
  });

  // One rule at a time over time.
  const ri = Math.min(view.perRule[side], r.rules.length - 1);
  if (ri >= 0) {
    const s = r.series.rules[ri];
    const box = column.querySelector(".box-rule");
    lineChart(box, {
      dx, xMax, marker, yLabel: "requests", pick: select,
      describe: (tt) => {
        const i = Math.min(Math.floor(tt / dx), s.matched.length - 1);
        return `${r.rules[ri].name}, ${fmtSeconds(i * dx)}: counted ${s.matched[i]}, allowed ${s.allowed[i]}, denied ${s.denied[i]}, would deny ${s.shadow_denied[i]}`;
      },
      series: [
        { label: `${r.rules[ri].name}: counted`, color: COLORS.offered, values: s.matched, dash: "4 3" },
        { label: "allowed", color: COLORS.admitted, values: s.allowed },
        { label: "denied", color: COLORS.denied, values: s.denied },
        { label: "would deny", color: COLORS.shadow, values: s.shadow_denied },
      ],
    });
    if (r.rules.length > 1) {
      const sel = document.createElement("div");
      sel.className = "chart-controls";
      sel.innerHTML = `rule <select>${r.rules.map((x, i) => `<option value="${i}"${i === ri ? " selected" : ""}>${esc(x.name)}</option>`).join("")}</select>`;
      sel.querySelector("select").addEventListener("change", (e) => { view.perRule[side] = +e.target.value; renderColumn(side); });
      box.prepend(sel);
    }
  }
  renderState(side, column.querySelector(".box-state"), xMax, marker);

  // Retry-After: one dot per denied request, by rule.
  const byRule = new Map();
  for (const q of r.requests) {
    if (q.retry_after == null) continue;
    const name = q.rule || "?";
    if (!byRule.has(name)) byRule.set(name, []);
    byRule.get(name).push([q.t, q.retry_after]);
  }
  const groups = [...byRule.entries()].map(([name, points], i) => ({
    label: `${name}`, color: i ? KEY_COLORS[(i + 2) % KEY_COLORS.length] : COLORS.denied, points,
  }));
  pointChart(column.querySelector(".box-retry"), {
    xMax, marker, groups, yLabel: "seconds", pick: select,
    describe: (tt) => { const q = r.requests[nearest(r, tt)]; return q && q.retry_after != null ? `${fmtSeconds(q.t)}: Retry-After ${q.retry_after}` : ""; },
  });
  if (!groups.length) column.querySelector(".box-retry").insertAdjacentHTML("afterbegin", `<p class="muted">No request was denied.</p>`);
}

// Remaining requests per key of one rule's limit, after each request the rule counted.
function renderState(side, box, xMax, marker) {
  const r = view.reports[side];
  if (!r.rules.length) return;
  const ri = Math.min(view.stateRule[side], r.rules.length - 1);
  const li = Math.min(view.stateLimit[side], r.rules[ri].limits.length - 1);
  const limit = r.rules[ri].limits[li];
  const perKey = new Map();
  for (const q of r.requests) {
    for (const o of q.outcomes) {
      if (o.rule !== ri || !o.state[li]) continue;
      const k = o.key ?? "";
      if (!perKey.has(k)) perKey.set(k, []);
      const s = o.state[li];
      perKey.get(k).push([q.t, s.tokens ?? s.remaining]);
    }
  }
  const keys = [...perKey.entries()].sort((x, y) => y[1].length - x[1].length);
  const shown = keys.slice(0, KEY_COLORS.length);
  const groups = shown.map(([k, points], i) => ({ label: k || "(one key)", color: KEY_COLORS[i], points, step: true }));
  const options = r.rules.flatMap((x, i) => x.limits.map((l, j) =>
    `<option value="${i}:${j}"${i === ri && j === li ? " selected" : ""}>${esc(x.name)}: ${esc(limitText(l))}</option>`));
  const controls = `<div class="chart-controls">limit <select>${options.join("")}</select>
    <span>${limit.algorithm === "token_bucket" ? "tokens" : "requests left"} per key after each request${keys.length > shown.length ? ` · the ${shown.length} busiest of ${keys.length} keys` : ""}</span></div>`;
  pointChart(box, {
    xMax, marker, groups, controls, yLabel: limit.algorithm === "token_bucket" ? "tokens" : "left", pick: select,
    describe: (tt) => {
      const q = r.requests[nearest(r, tt)];
      const o = q?.outcomes.find((x) => x.rule === ri);
      if (!o || !o.state[li]) return "";
      const s = o.state[li];
      return `${fmtSeconds(q.t)} ${o.key ?? ""}: ${s.remaining} left${s.tokens != null ? ` (${s.tokens.toFixed(2)} tokens)` : ""}`;
    },
  });
  box.querySelector("select").addEventListener("change", (e) => {
    const [i, j] = e.target.value.split(":").map(Number);
    view.stateRule[side] = i;
    view.stateLimit[side] = j;
    renderColumn(side);
  });
}

// ---------- one request ----------

function nearest(report, t) {
  const q = report.requests;
  let lo = 0, hi = q.length - 1;
  if (hi < 0) return -1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (q[mid].t < t) lo = mid + 1; else hi = mid;
  }
  return lo > 0 && Math.abs(q[lo - 1].t - t) <= Math.abs(q[lo].t - t) ? lo - 1 : lo;
}

function select(t) {
  const r = view.reports.a || view.reports.b;
  if (!r) return;
  const i = nearest(r, t);
  if (i >= 0) selectIndex(i);
}

function selectIndex(i) {
  const r = view.reports.a || view.reports.b;
  if (!r || !r.requests.length) return;
  view.selected = Math.max(0, Math.min(i, r.requests.length - 1));
  renderAll();
}

function answerHtml(side, q, report) {
  const lines = [`<span class="s${q.status}">HTTP/1.1 ${q.status} ${STATUS_TEXT[q.status] || ""}</span>`];
  if (q.status === 200) lines.push(`<span class="c"># the upstream's answer; sluice adds:</span>`);
  for (const [n, v] of q.headers) lines.push(`<span class="h">${esc(n)}</span>: ${esc(v)}`);
  if (q.status === 200 && !q.headers.length) lines.push(`<span class="c"># (no header: no rule counted it, or "headers": "none")</span>`);
  if (q.body) lines.push("", esc(q.body));
  const why = q.decision === "admitted" ? "" : q.decision === "delayed" ? ` held ${q.delay_ms.toFixed(0)} ms` : q.rule ? ` by ${esc(q.rule)}` : "";
  const outcomes = q.outcomes.map((o) => {
    const ruleInfo = report.rules[o.rule];
    const states = o.state.map((s, j) => `${esc(limitText(ruleInfo.limits[j]))}: ${s.remaining} left${s.tokens != null ? ` (${s.tokens.toFixed(2)} tokens)` : ""}`);
    return `<li><b>${esc(ruleInfo.name)}</b> ${esc(o.outcome.replace("_", " "))}${o.key != null ? `, key <code>${esc(o.key)}</code>` : ""}${states.length ? ` — then ${states.join("; ")}` : ""}</li>`;
  });
  return `<div class="answer" data-side="${side}">
    <div><span class="tag tag-${side}">${side.toUpperCase()}</span> <span class="pill ${q.decision}">${q.decision}</span>${why}${q.retry_after != null ? ` · Retry-After ${q.retry_after} s` : ""}</div>
    <pre>${lines.join("\n")}</pre>
    ${outcomes.length ? `<ul class="outcomes">${outcomes.join("")}</ul>` : `<p class="muted">No rule counted this request.</p>`}
  </div>`;
}

function renderDetail() {
  const box = $("detail");
  const shown = sides().filter((s) => view.reports[s]);
  const first = shown.length ? view.reports[shown[0]] : null;
  if (view.selected == null || !first || !first.requests[view.selected]) {
    box.innerHTML = "";
    $("detail-hint").hidden = false;
    return;
  }
  $("detail-hint").hidden = true;
  const q = first.requests[view.selected];
  box.className = `detail${shown.length === 2 ? " two" : ""}`;
  box.innerHTML = `<p class="muted" style="grid-column: 1 / -1; margin: 0">Request ${view.selected + 1} of ${first.requests.length} · at ${q.t.toFixed(3)} s · client <code>${esc(q.client)}</code> · <code>${esc(q.method)} ${esc(q.path)}</code> (trace line ${q.line})</p>`
    + shown.map((s) => answerHtml(s, view.reports[s].requests[view.selected], view.reports[s])).join("");
}

// ---------- the scenario in the URL ----------

function b64url(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function unb64url(text) {
  const s = atob(text.replace(/-/g, "+").replace(/_/g, "/"));
  return Uint8Array.from(s, (c) => c.charCodeAt(0));
}

async function pipe(bytes, stream) {
  const out = new Blob([bytes]).stream().pipeThrough(stream);
  return new Uint8Array(await new Response(out).arrayBuffer());
}

function scenario() {
  const s = { v: 1, a: $("config-a").value, traffic: traffic() };
  if ($("compare").checked) s.b = $("config-b").value;
  if (s.traffic.pattern === "csv") s.csv = $("csv").value;
  return s;
}

async function encodeScenario() {
  const json = new TextEncoder().encode(JSON.stringify(scenario()));
  if (typeof CompressionStream === "function") return `z=${b64url(await pipe(json, new CompressionStream("deflate-raw")))}`;
  return `j=${b64url(json)}`;
}

async function decodeScenario(hash) {
  const [kind, data] = [hash.slice(0, 2), hash.slice(2)];
  if (kind === "z=") return JSON.parse(new TextDecoder().decode(await pipe(unb64url(data), new DecompressionStream("deflate-raw"))));
  if (kind === "j=") return JSON.parse(new TextDecoder().decode(unb64url(data)));
  return null;
}

let saving = 0;
async function saveToUrl() {
  const mine = ++saving;
  try {
    const hash = await encodeScenario();
    if (mine === saving) history.replaceState(null, "", `#${hash}`);
  } catch { /* the URL keeps the previous scenario */ }
}

function apply(s) {
  if (typeof s.a === "string") $("config-a").value = s.a;
  $("compare").checked = typeof s.b === "string";
  if (typeof s.b === "string") $("config-b").value = s.b;
  for (const f of TRAFFIC_FIELDS) if (s.traffic && s.traffic[f] != null) $(f).value = s.traffic[f];
  if (typeof s.csv === "string") $("csv").value = s.csv;
}

// ---------- wiring ----------

function debounce(fn, ms) {
  let timer;
  return () => { clearTimeout(timer); timer = setTimeout(fn, ms); };
}

async function main() {
  try {
    await init();
  } catch (e) {
    $("error").hidden = false;
    $("error").textContent = `The WebAssembly module did not load (${e}). Build it with: make playground`;
    document.body.dataset.state = "failed";
    return;
  }
  $("version").textContent = `core ${version()}`;
  for (const side of ["a", "b"]) {
    const sel = $(`preset-${side}`);
    sel.innerHTML = `<option value="">Examples…</option>` + Object.keys(PRESETS).map((k) => `<option>${esc(k)}</option>`).join("");
    sel.addEventListener("change", () => {
      if (!sel.value) return;
      $(`config-${side}`).value = pretty(PRESETS[sel.value]);
      sel.value = "";
      check(side);
      run();
    });
  }
  $("config-a").value = pretty(PRESETS["Token bucket: 60 a minute, burst 10"]);
  $("config-b").value = pretty(PRESETS[PRESET_B]);
  $("pattern").value = "bursts";
  $("rate").value = "0.8";
  if (location.hash.length > 3) {
    try {
      const s = await decodeScenario(location.hash.slice(1));
      if (s) apply(s);
    } catch {
      $("error").hidden = false;
      $("error").textContent = "The link's scenario could not be read; showing the default one.";
    }
  }
  $("b-box").hidden = !$("compare").checked;
  showPatternFields();

  const later = debounce(run, 350);
  for (const side of ["a", "b"]) {
    const box = $(`config-${side}`);
    const live = () => { if (check(side)) later(); };
    box.addEventListener("input", live);
    box.addEventListener("change", live);
  }
  for (const f of TRAFFIC_FIELDS) $(f).addEventListener("input", later);
  $("pattern").addEventListener("change", () => { showPatternFields(); later(); });
  $("csv").addEventListener("input", later);
  $("compare").addEventListener("change", () => { $("b-box").hidden = !$("compare").checked; run(); });
  $("run").addEventListener("click", run);
  $("prev").addEventListener("click", () => selectIndex((view.selected ?? 1) - 1));
  $("next").addEventListener("click", () => selectIndex((view.selected ?? -1) + 1));
  $("next-denied").addEventListener("click", () => {
    const r = view.reports.a || view.reports.b;
    if (!r) return;
    const from = (view.selected ?? -1) + 1;
    const i = r.requests.findIndex((q, j) => j >= from && q.decision !== "admitted");
    if (i >= 0) selectIndex(i);
  });
  // Charts are drawn at their box's width: again when it changes.
  let width = window.innerWidth;
  window.addEventListener("resize", debounce(() => {
    if (Math.abs(window.innerWidth - width) < 8) return;
    width = window.innerWidth;
    renderAll();
  }, 150));
  document.addEventListener("keydown", (e) => {
    if (/^(INPUT|TEXTAREA|SELECT)$/.test(document.activeElement?.tagName || "")) return;
    if (e.key === "ArrowLeft") selectIndex((view.selected ?? 1) - 1);
    if (e.key === "ArrowRight") selectIndex((view.selected ?? -1) + 1);
  });
  $("share").addEventListener("click", async () => {
    await saveToUrl();
    try {
      await navigator.clipboard.writeText(location.href);
      $("share").textContent = "Link copied";
    } catch {
      $("share").textContent = "Link in the address bar";
    }
    setTimeout(() => { $("share").textContent = "Copy link"; }, 1600);
  });
  check("a");
  if ($("compare").checked) check("b");
  run();
  document.body.dataset.state = "ready";
}

main();
