#!/usr/bin/env python3
"""Plots the accuracy benchmark: what four proxies sharing one limit admitted vs one exact token bucket, over time.

Reads the arrivals `cargo run -p sluice-tests --example accuracy` writes (target/accuracy-series.csv:
interval_ms,at_us,exact,fleet, one line per request) and writes bench/accuracy.svg: above, requests offered and
admitted per 250 ms (the exact limiter, and the fleet at each sync interval); below, the fleet's admissions minus
the exact limiter's, accumulated. Standard library only. `make bench-accuracy` runs it after the benchmark.
"""

import argparse
import csv
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN_US = 250_000
COLORS = ["#2f5bd3", "#d97706", "#9333ea", "#0891b2", "#db2777"]


def read(path):
    runs = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            runs[int(row["interval_ms"])].append((int(row["at_us"]), row["exact"] == "1", row["fleet"] == "1"))
    return dict(sorted(runs.items()))


def nice(top):
    for step in (1, 2, 2.5, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000):
        if top / step <= 5:
            return step
    return top / 5


def panel(out, x0, y0, w, h, t_max, y_min, y_max, label):
    """Axes of one panel; returns (x, y) scales."""
    step = nice(max(y_max - y_min, 1))
    lo = step * (y_min // step)
    hi = step * -(-y_max // step)
    if hi == lo:
        hi = lo + step
    x = lambda t: x0 + w * t / t_max
    y = lambda v: y0 + h - h * (v - lo) / (hi - lo)
    v = lo
    while v <= hi + 1e-9:
        out.append(f'<line x1="{x0}" x2="{x0 + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eef0f3"/>')
        out.append(f'<text x="{x0 - 6}" y="{y(v) + 3.5:.1f}" text-anchor="end" class="t">{v:g}</text>')
        v += step
    if lo < 0 < hi:
        out.append(f'<line x1="{x0}" x2="{x0 + w}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#9aa3af"/>')
    for s in range(0, int(t_max) + 1, 2):
        out.append(f'<line x1="{x(s):.1f}" x2="{x(s):.1f}" y1="{y0}" y2="{y0 + h}" stroke="#e3e6ea" stroke-dasharray="3 3"/>')
        out.append(f'<text x="{x(s):.1f}" y="{y0 + h + 14}" text-anchor="middle" class="t">{s} s</text>')
    out.append(f'<text x="{x0}" y="{y0 - 8}" class="h">{label}</text>')
    return x, y


def path(points, x, y):
    return "M" + "L".join(f"{x(t):.1f} {y(v):.1f}" for t, v in points)


def plot(runs, svg_path):
    any_run = next(iter(runs.values()))
    t_max = max(a[0] for a in any_run) / 1e6
    t_max = max(2.0, 2 * -(-t_max // 2))
    bins = int(t_max * 1e6 // BIN_US)
    per_sec = 1e6 / BIN_US

    def rate(arrivals, pick):
        counts = [0] * bins
        for at, exact, fleet in arrivals:
            if pick(exact, fleet):
                counts[min(at // BIN_US, bins - 1)] += 1
        return [((i + 0.5) * BIN_US / 1e6, c * per_sec) for i, c in enumerate(counts)]

    offered = rate(any_run, lambda e, f: True)
    exact = rate(any_run, lambda e, f: e)
    fleets = {ms: rate(a, lambda e, f: f) for ms, a in runs.items()}
    drift = {}
    for ms, arrivals in runs.items():
        acc, pts = 0, [(0.0, 0)]
        for at, e, f in arrivals:
            acc += int(f) - int(e)
            pts.append((at / 1e6, acc))
        drift[ms] = pts

    width, height, left = 760, 560, 58
    w = width - left - 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'font-family="system-ui, -apple-system, Segoe UI, Roboto, Arial, sans-serif">',
           '<style>.t{font-size:11px;fill:#667085}.h{font-size:13px;font-weight:600;fill:#1f2933}'
           '.l{font-size:12px;fill:#1f2933}</style>',
           f'<rect width="{width}" height="{height}" fill="#fff"/>']
    top = max(v for _, v in offered)
    x, y = panel(out, left, 40, w, 250, t_max, 0, top * 1.05,
                 "Requests per second (250 ms bins): offered, one exact token bucket, four proxies sharing it")
    out.append(f'<path d="{path(offered, x, y)}" fill="none" stroke="#94a3b8" stroke-width="2"/>')
    for i, (ms, pts) in enumerate(fleets.items()):
        out.append(f'<path d="{path(pts, x, y)}" fill="none" stroke="{COLORS[i % len(COLORS)]}" stroke-width="1.4" opacity=".9"/>')
    out.append(f'<path d="{path(exact, x, y)}" fill="none" stroke="#16a34a" stroke-width="2.2" stroke-dasharray="5 3"/>')
    lo = min(min(v for _, v in pts) for pts in drift.values())
    hi = max(max(v for _, v in pts) for pts in drift.values())
    x2, y2 = panel(out, left, 350, w, 160, t_max, min(lo, -1), max(hi, 1),
                   "Admitted by the fleet minus admitted by the exact limiter, accumulated")
    for i, (ms, pts) in enumerate(drift.items()):
        out.append(f'<path d="{path(pts, x2, y2)}" fill="none" stroke="{COLORS[i % len(COLORS)]}" stroke-width="1.6"/>')
    items = [("offered", "#94a3b8", ""), ("exact", "#16a34a", "5 3")]
    items += [(f"fleet, sync {ms} ms", COLORS[i % len(COLORS)], "") for i, ms in enumerate(fleets)]
    lx = left
    for name, color, dash in items:
        out.append(f'<line x1="{lx}" x2="{lx + 18}" y1="{height - 16}" y2="{height - 16}" stroke="{color}" stroke-width="2.4"'
                   + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
        out.append(f'<text x="{lx + 23}" y="{height - 12}" class="l">{name}</text>')
        lx += 34 + 6.3 * len(name)
    out.append("</svg>")
    with open(svg_path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=os.path.join(ROOT, "target", "accuracy-series.csv"), help="the benchmark's arrivals")
    parser.add_argument("--svg", default=os.path.join(ROOT, "bench", "accuracy.svg"), help="where the plot goes")
    args = parser.parse_args()
    if not os.path.exists(args.csv):
        sys.exit(f"{args.csv} is missing: run make bench-accuracy")
    runs = read(args.csv)
    if not runs:
        sys.exit(f"{args.csv} has no arrivals")
    plot(runs, args.svg)
    print(f"plot: {os.path.relpath(args.svg, ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
