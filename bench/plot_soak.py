#!/usr/bin/env python3
"""Plots the soak: memory, Redis keys, answers at the edge and sync errors over the run.

Reads the samples the soak test writes (target/soak-series.csv, one line every few seconds: cumulative counters and
memory gauges; `SLUICE_SOAK_SECS=600 cargo test -p sluice-tests --features envoy,redis --test soak`) and writes
bench/soak.svg: memory (Envoy's allocated heap, heap size and RSS, the counter service's RSS, Redis's used_memory),
Redis's key count, answers per second at the edge (200, 429, anything else), syncs and their errors per second and
the sync interval the service advises;
the warm-up (the first fifth, after which the test asserts the series are flat) is shaded. Standard library only.
`make soak` runs it after the soak.
"""

import argparse
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


def read(path):
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def nice(top):
    for step in (0.01, 0.02, 0.05, 0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 25, 50, 60, 100, 120, 200, 250, 500,
                 1000, 2000, 5000, 10000, 20000, 50000):
        if top / step <= 5:
            return step
    return top / 5


def panel(out, x0, y0, w, h, t_max, y_max, label):
    """Axes of one panel (from 0); returns (x, y) scales."""
    step = nice(max(y_max, 1e-9))
    hi = step * max(1, -(-y_max // step))
    x = lambda t: x0 + w * t / t_max
    y = lambda v: y0 + h - h * v / hi
    v = 0
    while v <= hi + 1e-9:
        out.append(f'<line x1="{x0}" x2="{x0 + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eef0f3"/>')
        out.append(f'<text x="{x0 - 6}" y="{y(v) + 3.5:.1f}" text-anchor="end" class="t">{v:g}</text>')
        v += step
    t_step = nice(t_max)
    s = 0
    while s <= t_max + 1e-9:
        out.append(f'<line x1="{x(s):.1f}" x2="{x(s):.1f}" y1="{y0}" y2="{y0 + h}" stroke="#e3e6ea" stroke-dasharray="3 3"/>')
        out.append(f'<text x="{x(s):.1f}" y="{y0 + h + 14}" text-anchor="middle" class="t">{s:g} s</text>')
        s += t_step
    out.append(f'<text x="{x0}" y="{y0 - 8}" class="h">{escape(label)}</text>')
    return x, y


def escape(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def path(points, x, y):
    return "M" + "L".join(f"{x(t):.1f} {y(v):.1f}" for t, v in points)


def rates(rows, column):
    """Per second between consecutive samples, at their midpoint (not over the last sample, taken just after the
    one at the end of the run)."""
    return [((a["t_s"] + b["t_s"]) / 2, (b[column] - a[column]) / (b["t_s"] - a["t_s"]))
            for a, b in zip(rows, rows[1:]) if b["t_s"] - a["t_s"] >= 0.5]


def plot(rows, svg_path):
    t_max = rows[-1]["t_s"]
    warm = t_max / 5
    width, left = 760, 64
    w = width - left - 20
    h = 150
    panels = 5 if "next_sync_ms" in rows[0] else 4
    tops = [40 + i * (h + 70) for i in range(panels)]
    height = tops[-1] + h + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'font-family="system-ui, -apple-system, Segoe UI, Roboto, Arial, sans-serif">',
           '<style>.t{font-size:11px;fill:#667085}.h{font-size:13px;font-weight:600;fill:#1f2933}'
           '.l{font-size:12px;fill:#1f2933}</style>',
           f'<rect width="{width}" height="{height}" fill="#fff"/>']

    def lines(top, label, series, unit=1.0):
        y_max = max(max(v for _, v in pts) for _, _, pts in series) / unit * 1.1
        x, y = panel(out, left, top, w, h, t_max, y_max, label)
        out.insert(3, f'<rect x="{left}" y="{top}" width="{x(warm) - left:.1f}" height="{h}" fill="#f4f5f7"/>')
        lx = left
        for name, color, pts in series:
            out.append(f'<path d="{path([(t, v / unit) for t, v in pts], x, y)}" fill="none" stroke="{color}" '
                       'stroke-width="1.8"/>')
            out.append(f'<line x1="{lx}" x2="{lx + 16}" y1="{top + h + 30}" y2="{top + h + 30}" stroke="{color}" '
                       'stroke-width="2.4"/>')
            out.append(f'<text x="{lx + 20}" y="{top + h + 34}" class="l">{name}</text>')
            lx += 30 + 6.3 * len(name)

    at = lambda column: [(r["t_s"], r[column]) for r in rows]
    lines(tops[0], "Memory, MiB (the warm-up shaded)", [
        ("Envoy allocated", "#2f5bd3", at("envoy_allocated")),
        ("Envoy heap size", "#93c5fd", at("envoy_heap_size")),
        ("Envoy RSS", "#0891b2", at("envoy_rss")),
        ("service RSS", "#d97706", at("service_rss")),
        ("Redis used_memory", "#dc2626", at("redis_used_memory")),
    ], unit=MIB)
    lines(tops[1], "Redis keys (DBSIZE)", [("keys", "#dc2626", at("redis_keys"))])
    others = [(t, a + b) for (t, a), (_, b) in zip(rates(rows, "server_errors"), rates(rows, "transport_errors"))]
    lines(tops[2], "Answers at the edge per second", [
        ("200", "#16a34a", rates(rows, "ok")),
        ("429", "#d97706", rates(rows, "denied")),
        ("5xx, other or none", "#dc2626", others),
    ])
    errors = [(t, a + b) for (t, a), (_, b) in zip(rates(rows, "sync_errors"), rates(rows, "check_failed"))]
    lines(tops[3], "Syncs and strict checks per second, and their errors", [
        ("syncs sent", "#2f5bd3", rates(rows, "sync_sent")),
        ("strict checks sent", "#9333ea", rates(rows, "check_sent")),
        ("sync or check errors", "#dc2626", errors),
    ])
    if panels == 5:
        lines(tops[4], "Sync interval the service advises (its backpressure hint), ms", [
            ("next_sync_ms", "#2f5bd3", at("next_sync_ms")),
        ])
    out.append("</svg>")
    with open(svg_path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=os.path.join(ROOT, "target", "soak-series.csv"), help="the soak's samples")
    parser.add_argument("--svg", default=os.path.join(ROOT, "bench", "soak.svg"), help="where the plot goes")
    args = parser.parse_args()
    if not os.path.exists(args.csv):
        sys.exit(f"{args.csv} is missing: run make soak")
    rows = read(args.csv)
    if len(rows) < 3:
        sys.exit(f"{args.csv} has too few samples")
    plot(rows, args.svg)
    print(f"plot: {os.path.relpath(args.svg, ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
