// Plain SVG charts: lines over time buckets, and points per request. No library.

// The width follows the chart's box (one SVG unit a pixel, so text keeps its size).
let W = 640;
const H = 190, L = 46, R = 12, T = 10, B = 26;
const fit = (box) => { W = Math.max(320, Math.round(box.clientWidth || 640)); };
const NS = "http://www.w3.org/2000/svg";

function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const p = Math.pow(10, Math.floor(Math.log10(raw || 1)));
  const m = raw / p;
  return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10) * p;
}

// Ticks from 0 by a round step: up to `max` itself (`cover`: up to the first tick at or past it).
function ticks(max, count, cover) {
  const step = niceStep(max, count);
  const top = cover ? Math.max(step, Math.ceil(max / step - 1e-9) * step) : max;
  const out = [];
  for (let v = 0; v <= top + step * 1e-9; v += step) out.push(+v.toFixed(10));
  return { step, top, values: out };
}

export function fmtSeconds(s) {
  if (s >= 3600 && s % 60 === 0) return `${(s / 3600).toFixed(s % 3600 ? 1 : 0)} h`;
  if (s >= 120) return `${(s / 60).toFixed(s % 60 ? 1 : 0)} min`;
  return `${+s.toFixed(2)} s`;
}

function esc(s) {
  return String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

// Axes, grid and the frame of a chart over [0, xMax] × [0, yMax]; returns the scales.
function frame(xMax, yMax, yLabel) {
  const xt = ticks(xMax, 6, false);
  const yt = ticks(yMax > 0 ? yMax : 1, 4, true);
  const x = (t) => L + ((W - L - R) * t) / (xt.top || 1);
  const y = (v) => H - B - ((H - B - T) * v) / (yt.top || 1);
  let s = `<g class="grid">`;
  for (const v of yt.values) s += `<line x1="${L}" x2="${W - R}" y1="${y(v)}" y2="${y(v)}"/>`;
  s += `</g><g class="axis">`;
  for (const v of yt.values) s += `<text x="${L - 6}" y="${y(v) + 3.5}" text-anchor="end">${+v.toFixed(3)}</text>`;
  for (const v of xt.values) s += `<text x="${x(v)}" y="${H - 8}" text-anchor="middle">${esc(fmtSeconds(v))}</text>`;
  s += `<line x1="${L}" x2="${W - R}" y1="${H - B}" y2="${H - B}"/>`;
  s += `<text x="${L - 38}" y="${T + 2}" text-anchor="start" transform="rotate(-90 ${L - 34} ${T + 2}) translate(-${H - B - T} 0)">${esc(yLabel || "")}</text>`;
  s += `</g>`;
  return { x, y, xTop: xt.top, svg: s };
}

function legend(items) {
  return `<div class="legend">${items
    .map((i) => `<span><i style="background:${i.color}${i.dash ? ";opacity:.6" : ""}"></i>${esc(i.label)}</span>`)
    .join("")}</div>`;
}

// Wires hover (a rule and a tooltip from `describe(t)`) and click (`pick(t)`) on the chart.
function interact(box, f, describe, pick) {
  const width = W;
  const svg = box.querySelector("svg");
  const tip = box.querySelector(".tip");
  const rule = svg.querySelector(".hover");
  const tAt = (ev) => {
    const r = svg.getBoundingClientRect();
    const px = ((ev.clientX - r.left) / r.width) * width;
    return Math.max(0, ((px - L) / (width - L - R)) * f.xTop);
  };
  svg.addEventListener("mousemove", (ev) => {
    const t = tAt(ev);
    const px = f.x(t);
    if (px > width - R) return;
    rule.setAttribute("x1", px);
    rule.setAttribute("x2", px);
    rule.style.display = "";
    const text = describe ? describe(t) : "";
    if (text) {
      const r = svg.getBoundingClientRect();
      tip.textContent = text;
      tip.style.left = `${(px / width) * r.width}px`;
      tip.style.top = `${(T / H) * r.height + 8}px`;
      tip.hidden = false;
    }
  });
  svg.addEventListener("mouseleave", () => {
    rule.style.display = "none";
    tip.hidden = true;
  });
  svg.addEventListener("click", (ev) => pick && pick(tAt(ev)));
}

function shell(f, body, marker) {
  const m = marker == null ? "" : `<line class="marker" x1="${f.x(marker)}" x2="${f.x(marker)}" y1="${T}" y2="${H - B}" stroke="#111827" stroke-dasharray="3 3" stroke-width="1"/>`;
  return `<svg xmlns="${NS}" viewBox="0 0 ${W} ${H}" role="img">${f.svg}${body}${m}<line class="hover" y1="${T}" y2="${H - B}" stroke="#94a3b8" style="display:none"/></svg><div class="tip" hidden></div>`;
}

// Counts per bucket: `series` [{label, color, values, dash}], bucket i covering [i·dx, (i+1)·dx).
export function lineChart(box, { dx, xMax, series, yLabel, marker, describe, pick }) {
  fit(box);
  const yMax = Math.max(1, ...series.flatMap((s) => s.values));
  const f = frame(xMax, yMax, yLabel);
  let body = "";
  for (const s of series) {
    if (!s.values.length) continue;
    // A step line: each bucket's count held over its width.
    let d = "";
    s.values.forEach((v, i) => {
      const x0 = f.x(i * dx), x1 = f.x(Math.min((i + 1) * dx, f.xTop));
      d += `${i ? "L" : "M"}${x0.toFixed(1)} ${f.y(v).toFixed(1)}L${x1.toFixed(1)} ${f.y(v).toFixed(1)}`;
    });
    body += `<path d="${d}" fill="none" stroke="${s.color}" stroke-width="${s.width || 1.6}"${s.dash ? ` stroke-dasharray="${s.dash}"` : ""}/>`;
  }
  box.innerHTML = legend(series) + `<div class="chart">${shell(f, body, marker)}</div>`;
  interact(box.querySelector(".chart"), f, describe, pick);
}

// Values per request: `groups` [{label, color, points: [[t, v], ...], step}], drawn as a step
// line (a limit's state) or as dots (Retry-After).
export function pointChart(box, { xMax, groups, yLabel, marker, describe, pick, controls }) {
  fit(box);
  const yMax = Math.max(1, ...groups.flatMap((g) => g.points.map((p) => p[1])));
  const f = frame(xMax, yMax, yLabel);
  let body = "";
  for (const g of groups) {
    if (!g.points.length) continue;
    let d = "";
    if (g.step) {
      g.points.forEach(([t, v], i) => {
        const px = f.x(t).toFixed(1), py = f.y(v).toFixed(1);
        d += i ? `H${px}V${py}` : `M${px} ${py}`;
      });
      body += `<path d="${d}" fill="none" stroke="${g.color}" stroke-width="1.4"/>`;
    } else {
      for (const [t, v] of g.points) d += `M${f.x(t).toFixed(1)} ${(f.y(v) - 1.5).toFixed(1)}h2.4v3h-2.4z`;
      body += `<path d="${d}" fill="${g.color}" opacity=".75"/>`;
    }
  }
  box.innerHTML = (controls || "") + legend(groups) + `<div class="chart">${shell(f, body, marker)}</div>`;
  interact(box.querySelector(".chart"), f, describe, pick);
}
