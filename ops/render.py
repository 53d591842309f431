#!/usr/bin/env python3
"""Renders the dashboard's panels (ops/grafana/sluice.json) as one SVG, from the data real Prometheus answered.

Reads the panels the ops test writes with SLUICE_OPS_RENDER=DIR (DIR/panels.json: each panel's title, unit and
series over the run; `SLUICE_OPS_RENDER=target cargo test -p sluice-tests --features envoy,redis --test
ops_prometheus`) and writes docs/dashboard.svg: a grid of the panels, in the dashboard's order, in the style of the
benchmarks' plots (bench/plot_soak.py). Standard library only. Where no Grafana is at hand, this is what the
dashboard shows for the test's run: load past a bulkhead's limit, then the counter service killed.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from plot_soak import escape, panel  # noqa: E402  (the benchmarks' axes and grid, one style for every plot)

COLORS = ["#2f5bd3", "#d97706", "#16a34a", "#dc2626", "#9333ea", "#0891b2", "#93c5fd", "#a16207"]
UNITS = {"reqps": "req/s", "percentunit": "share", "ms": "ms", "short": ""}


def plot(panels, svg_path):
    t_max = max((p[0] for panel_ in panels for s in panel_["series"] for p in s["points"]), default=1) or 1
    cols, cell_w, cell_h, h, left = 2, 520, 250, 140, 56
    rows = -(-len(panels) // cols)
    width, height = cols * cell_w, rows * cell_h + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="system-ui, -apple-system, Segoe UI, Roboto, Arial, sans-serif">',
           '<style>.t{font-size:10px;fill:#667085}.h{font-size:12px;font-weight:600;fill:#1f2933}'
           '.l{font-size:10.5px;fill:#1f2933}</style>',
           f'<rect width="{width}" height="{height}" fill="#fff"/>']
    for i, p in enumerate(panels):
        x0 = (i % cols) * cell_w + left
        y0 = (i // cols) * cell_h + 36
        w = cell_w - left - 24
        series = [s for s in p["series"] if s["points"]]
        y_max = max((v for s in series for _, v in s["points"]), default=1) * 1.1 or 1
        unit = UNITS.get(p.get("unit") or "", p.get("unit") or "")
        x, y = panel(out, x0, y0, w, h, t_max, y_max, p["title"] + (f" ({unit})" if unit and unit not in p["title"] else ""))
        lx, ly = x0, y0 + h + 32
        for j, s in enumerate(series[:6]):
            color = COLORS[j % len(COLORS)]
            d = "M" + "L".join(f"{x(t):.1f} {y(v):.1f}" for t, v in s["points"])
            out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.6"/>')
            name = s["legend"] or "value"
            if lx + 30 + 5.8 * len(name) > x0 + w:
                lx, ly = x0, ly + 15
            out.append(f'<line x1="{lx}" x2="{lx + 14}" y1="{ly - 3.5}" y2="{ly - 3.5}" stroke="{color}" '
                       'stroke-width="2.2"/>')
            out.append(f'<text x="{lx + 18}" y="{ly}" class="l">{escape(name)}</text>')
            lx += 28 + 5.8 * len(name)
    out.append("</svg>")
    with open(svg_path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("panels", help="panels.json written by the ops test (SLUICE_OPS_RENDER=DIR)")
    parser.add_argument("--svg", default=os.path.join(ROOT, "docs", "dashboard.svg"), help="where the plot goes")
    args = parser.parse_args()
    with open(args.panels) as f:
        panels = json.load(f)["panels"]
    if not panels:
        sys.exit(f"{args.panels} has no panel")
    plot(panels, args.svg)
    print(f"plot: {os.path.relpath(args.svg, ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
