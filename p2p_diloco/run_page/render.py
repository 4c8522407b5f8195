"""The run's page as HTML: a summary, SVG plots drawn here on the server, and the peers' table.

Every string that comes from a peer (its ID, device, version, phase, the run's name) goes through
:func:`html.escape`, so a record that carries markup shows as text. The page needs nothing from
elsewhere: its style and its one script (``static/``, which refreshes ``<main>`` from ``/main``
every few seconds) come from the same server, and the server forbids every other source with a
Content-Security-Policy (:mod:`.server`).
"""

from __future__ import annotations

import html
import time
from typing import Any, Optional

from p2p_diloco.run_page.history import KEEPING, SERIES
from p2p_diloco.swarm.status import EXCLUDED_AFTER_ROUNDS
from p2p_diloco.swarm.status_report import COLUMNS, counted_cell, peer_cells

PLOT_W, PLOT_H = 340, 150
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 52, 10, 22, 22


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def si(number: Optional[float], unit: str = "") -> str:
    """1234567 -> '1.23M'; None -> '-'."""
    if number is None:
        return "-"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= factor:
            return f"{number / factor:.3g}{prefix}{unit}"
    return f"{number:.4g}{unit}" if isinstance(number, float) else f"{number}{unit}"


def plot(name: str, series: dict[str, list]) -> str:
    """One series as an SVG line chart over outer steps, its last value in the title."""
    title, unit = SERIES[name]
    steps, values = series["steps"], series["values"]
    last = f": {si(values[-1], unit)}" if values else ""
    parts = [f'<svg class="plot" data-series="{esc(name)}" viewBox="0 0 {PLOT_W} {PLOT_H}" width="{PLOT_W}" '
             f'height="{PLOT_H}" role="img" aria-label="{esc(title)}">',
             f'<text x="{MARGIN_L}" y="14" class="title">{esc(title)}{esc(last)}</text>']
    x0, x1, y0, y1 = MARGIN_L, PLOT_W - MARGIN_R, PLOT_H - MARGIN_B, MARGIN_T
    parts.append(f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" class="frame"/>')
    if not values:
        parts.append(f'<text x="{(x0 + x1) / 2}" y="{(y0 + y1) / 2}" class="empty">no data yet</text></svg>')
        return "".join(parts)
    lo, hi = min(values), max(values)
    if hi == lo:
        lo, hi = lo - (abs(lo) * 0.05 or 0.5), hi + (abs(hi) * 0.05 or 0.5)
    first, final = steps[0], steps[-1]
    span = max(final - first, 1)

    def xy(step: int, value: float) -> str:
        x = x0 + (x1 - x0) * ((step - first) / span if final > first else 0.5)
        return f"{x:.1f},{y0 - (y0 - y1) * (value - lo) / (hi - lo):.1f}"

    points = " ".join(xy(s, v) for s, v in zip(steps, values))
    parts.append(f'<polyline points="{points}" class="line"/>')
    if len(values) == 1:
        x, y = xy(steps[0], values[0]).split(",")
        parts.append(f'<circle cx="{x}" cy="{y}" r="3" class="dot"/>')
    parts += [f'<text x="{x0 - 4}" y="{y1 + 4}" class="ylabel">{esc(si(hi))}</text>',
              f'<text x="{x0 - 4}" y="{y0}" class="ylabel">{esc(si(lo))}</text>',
              f'<text x="{x0}" y="{PLOT_H - 6}" class="xlabel">step {first}</text>',
              f'<text x="{x1}" y="{PLOT_H - 6}" class="xlabel end">step {final}</text></svg>']
    return "".join(parts)


CONTRIBUTION = ("rounds", "group", "excluded")
PEER_COLUMNS = (*COLUMNS[:COLUMNS.index("counted") + 1], *CONTRIBUTION, *COLUMNS[COLUMNS.index("counted") + 1:])


def _exclusion(rounds_not_applied: int) -> str:
    if rounds_not_applied >= EXCLUDED_AFTER_ROUNDS:
        return f"yes ({rounds_not_applied} rounds)"
    return f"{rounds_not_applied} round(s) void" if rounds_not_applied else "-"


def peer_row(r: dict, main: Optional[str]) -> str:
    """The cells of `status`'s table, and the peer's contribution (its claims)."""
    text = dict(peer_cells(r, main), claimed=si(r.get("samples", 0)), counted=counted_cell(r, si),
                rounds=str(r.get("rounds", 0)),
                group=str(r.get("group_size") or "-"), excluded=_exclusion(r.get("rounds_not_applied", 0)))
    cells = [f'<td class="peer" title="{esc(r["peer_id"])}">{esc(r["peer_id"][-12:])}</td>',
             *(f"<td>{esc(text[column])}</td>" for column in PEER_COLUMNS[1:])]
    return f'<tr data-peer-id="{esc(r["peer_id"])}">{"".join(cells)}</tr>'


def run_section(run: dict[str, Any]) -> str:
    """One run: its summary, its plots and its peers."""
    summary = run.get("summary") or {}
    main = summary.get("fingerprint")
    facts = [("outer step", summary.get("outer_step", "-")), ("live peers", summary.get("live_peers", "-")),
             ("tokens trained", si(summary.get("tokens_trained"))),
             ("throughput", si(summary.get("tokens_per_s"), " tokens/s")),
             ("training loss", "-" if summary.get("loss") is None else f"{summary['loss']:.3f}"),
             ("held-out loss", "-" if summary.get("eval_loss") is None else f"{summary['eval_loss']:.3f}"),
             ("keepers", summary.get("keepers", 0)), ("settings", (main or "-")[:12])]
    if summary.get("other_settings"):
        facts.append(("on other settings", summary["other_settings"]))
    history = run.get("history") or {}
    rows = "".join(peer_row(r, main) for r in run["peers"] if r["phase"] != KEEPING)
    keepers = [r for r in run["peers"] if r["phase"] == KEEPING]
    kept = "" if not keepers else '<p class="keepers">kept by ' + ", ".join(
        f'<span class="peer" title="{esc(r["peer_id"])}">{esc(r["peer_id"][-12:])}</span> at outer step '
        f'{esc(r["outer_step"])}' + ("" if r.get("eval_step") is None else f' (held-out loss evaluated at step '
                                                                          f'{esc(r["eval_step"])})')
        for r in keepers) + "</p>"
    return (f'<section class="run" data-run="{esc(run["run"])}"><h2>run {esc(run["run"])}</h2>'
            '<dl class="facts">' + "".join(f'<div><dt>{esc(k)}</dt><dd data-fact="{esc(k)}">{esc(v)}</dd></div>'
                                          for k, v in facts) + "</dl>"
            '<div class="plots">' + "".join(plot(name, history.get(name, dict(steps=[], values=[])))
                                            for name in SERIES) + "</div>"
            f'<table class="peers"><thead><tr>{"".join(f"<th>{esc(c)}</th>" for c in PEER_COLUMNS)}</tr></thead>'
            f"<tbody>{rows}</tbody></table>{kept}</section>")


def render_main(api: dict[str, Any]) -> str:
    """The page's ``<main>``: what ``/main`` serves and the script swaps in."""
    updated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(api["time"])) if api.get("time") else "not yet"
    runs = "".join(run_section(run) for run in api["runs"]) or \
        "<p>no run found on this swarm yet: no peer announces one</p>"
    return f'<p class="updated">read from the DHT at <span id="updated">{esc(updated)}</span></p>{runs}'


def render_page(api: dict[str, Any], refresh_s: float) -> str:
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<title>p2p-diloco run</title><link rel=\"stylesheet\" href=\"page.css\">"
            f"<script src=\"page.js\" defer></script></head><body data-refresh-s=\"{refresh_s:g}\">"
            "<header><h1>p2p-diloco</h1><span class=\"note\">what the peers' signed status records claim; "
            "plots over outer steps</span></header>"
            f"<main id=\"main\">{render_main(api)}</main></body></html>")
