"""The HTML report (``harness report``): one self-contained file that works
offline, drawn with plotly (plotly.js inlined once, no CDN, no MathJax).

Layout, top to bottom: the summary table (the ``--json`` figures of
``harness check``; with ``--against``, both runs side by side and their
difference), the divergence (when the runs or a replay differ), the
timeline (one x axis shared by six panels: KV blocks free / held / cached,
waiting / running queue lengths, tokens per step split prefill / decode /
drafts, preemptions with their victims, prefix hit rate and draft
acceptance, remote KV loads; a button switches the x axis between steps and
virtual time; violations and the first divergence are vertical lines with
their witness on hover), the per-request Gantt (waiting / running /
preempted / loading spans) and the violations with their witnesses.

Deterministic: the same series give the same bytes (fixed div ids, figures
serialised from plain lists, no timestamps). Every figure comes from
``harness.view.series`` (nothing is recomputed here).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from harness.check.invariants import INVARIANTS
from harness.view.series import STATES, Series

#: The timeline's panels, in order: (title, y-axis title).
PANELS = (("KV blocks", "blocks"), ("Queues", "requests"), ("Tokens per step", "tokens"),
          ("Preemptions", "victims"), ("Prefix hits and draft acceptance", "rate"),
          ("Remote KV loads", "loads"))
#: Colours of the Gantt's states (``series.STATES``).
STATE_COLOURS = {"waiting": "#f2c14e", "running": "#3a86ff", "preempted": "#e63946", "loading": "#8338ec"}
#: Most requests the Gantt draws (the earliest arrivals); the rest are named in a note.
GANTT_MAX_REQUESTS = 600


@dataclass
class Divergence:
    """Where two runs (``--against``, ``harness diff``) or a trace and its
    replay first differ: ``step`` and a one-line ``text``."""

    step: int
    text: str


@dataclass(frozen=True)
class OwnRunView:
    """The candidate's own run of a replayed trace's inputs
    (``harness.replay.OwnRun``) as the report shows it: the replay's
    ``own run: ...`` line (``harness.report.own_run_line``), whether it
    passed, and its violations (``Violation.to_dict``: the first few of
    each invariant)."""

    line: str
    ok: bool
    violations: tuple[dict[str, Any], ...] = ()
    num_violations: int = 0


def _own_run(own: OwnRunView) -> str:
    parts = ["<h2>Own run</h2>",
             f'<p id="own-run" class="{"same" if own.ok else "divergence"}"><b>{_e(own.line)}</b></p>']
    if own.num_violations > len(own.violations):
        parts.append(f"<p>{own.num_violations} in all; the first few of each invariant are shown.</p>")
    for v in own.violations:
        inv = INVARIANTS.get(v["invariant"])
        parts.append(f'<div class="violation"><b>{_e(v["invariant"])}</b> at step {v["step"]}'
                     + (f', request {_e(v["request"])}' if v.get("request") else "") + f': {_e(v["message"])}'
                     + (f"<br>rule ({_e(inv.layer)}): {_e(inv.statement)}" if inv else "")
                     + (f'<pre>{_e(chr(10).join(v["history"]))}</pre>' if v.get("history") else "") + "</div>")
    return "\n".join(parts)


def render(series: Series, summary: dict[str, Any], *, against: Series | None = None,
           against_summary: dict[str, Any] | None = None, divergence: Divergence | None = None,
           title: str | None = None, own_run: OwnRunView | None = None) -> bytes:
    """The report as UTF-8 HTML bytes. ``summary``: the ``--json`` figures of
    ``series``'s trace (``harness.report.report_dict``); ``against`` /
    ``against_summary``: a second run to overlay (dashed, "B"); ``divergence``:
    the first difference to highlight; ``own_run``: a replay under the fork
    gate (or safety) whose decisions differ, where the divergence is
    information and the candidate's own run of the trace's inputs is the
    verdict (``replay --report``)."""
    name = title or f"sched-harness report: {series.path}"
    parts = [f"<h1>{_e(name)}</h1>", _summary_table(summary, against_summary)]
    if divergence is not None and own_run is not None:
        parts.append(f'<p class="information" id="first-divergence"><b>Decisions differ from step '
                     f'{divergence.step}</b> (information: not held to a version\'s design): '
                     f'{_e(divergence.text)}</p>')
    elif divergence is not None:
        parts.append(f'<p class="divergence" id="first-divergence"><b>First divergence at step '
                     f'{divergence.step}</b>: {_e(divergence.text)}</p>')
    elif against is not None:
        parts.append('<p class="same">The two runs made identical decisions.</p>')
    if own_run is not None:
        parts.append(_own_run(own_run))
    figures = [("timeline", _timeline(series, against, divergence)), ("gantt", _gantt(series))]
    for div_id, fig in figures:
        parts.append(f'<h2>{"Timeline" if div_id == "timeline" else "Requests (Gantt)"}</h2>')
        if div_id == "gantt" and len(series.requests) > GANTT_MAX_REQUESTS:
            parts.append(f"<p>The first {GANTT_MAX_REQUESTS} of {len(series.requests)} requests "
                         f"(by arrival) are drawn.</p>")
        parts.append(fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                                 include_mathjax=False, config={"displaylogo": False}))
    parts.append(_violations(series, "Violations" + (" (A)" if against is not None else "")))
    if against is not None:
        parts.append(_violations(against, "Violations (B)"))
    body = "\n".join(parts)
    page = (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(name)}</title><style>{_CSS}</style>\n"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script>\n</head><body>\n{body}\n"
            f"</body></html>\n")
    return page.encode("utf-8")


_CSS = ("body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}th{background:#f4f4f4}"
        "td.k{text-align:left}.divergence{color:#b00020}.information{color:#8a5a00}pre{background:#f8f8f8;padding:4px;"
        "white-space:pre-wrap}")


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


#: The summary's rows: (key of ``report_dict``, label).
SUMMARY_ROWS = (("verdict", "verdict"), ("engine", "engine"), ("profile", "profile"), ("steps", "steps"), ("requests", "requests"),
                ("finished", "finished"), ("rejected", "rejected"), ("aborted", "aborted"),
                ("preemptions", "preemptions"), ("prefix_hit_tokens", "prefix-hit tokens"),
                ("draft_tokens", "draft tokens"), ("rejected_draft_tokens", "rejected draft tokens"),
                ("deferred_frees", "deferred frees drained"),
                ("deferred_prefill_steps", "steps deferring prefills"),
                ("remote_kv_loads", "remote KV loads"), ("failed_kv_loads", "failed KV loads"),
                ("num_violations", "violations"))


def _summary_table(a: dict[str, Any], b: dict[str, Any] | None) -> str:
    head = "<tr><th>figure</th><th>A</th><th>B</th><th>B - A</th></tr>" if b is not None \
        else "<tr><th>figure</th><th>value</th></tr>"
    rows = [f'<table id="summary">{head}', f'<tr><td class="k">trace</td><td>{_e(a.get("trace"))}</td>'
            + (f'<td>{_e(b.get("trace"))}</td><td></td>' if b is not None else "") + "</tr>"]
    for key, label in SUMMARY_ROWS:
        va = a.get(key)
        cells = f"<td>{_e(va)}</td>"
        if b is not None:
            vb = b.get(key)
            delta = vb - va if isinstance(va, int) and isinstance(vb, int) \
                and not isinstance(va, bool) else ""
            cells += f"<td>{_e(vb)}</td><td>{_e(delta)}</td>"
        rows.append(f'<tr><td class="k">{_e(label)}</td>{cells}</tr>')
    by_inv = a.get("violations_by_invariant") or {}
    if by_inv:
        counts = ", ".join(f"{k} ×{v}" for k, v in sorted(by_inv.items()))
        rows.append(f'<tr><td class="k">violations by invariant</td><td colspan="3">{_e(counts)}</td></tr>')
    rows.append("</table>")
    return "\n".join(rows)


def _columns(series: Series) -> dict[str, list[Any]]:
    """The timeline's per-step columns (plain lists, so the JSON is stable)."""
    pts = series.steps
    rate = []
    cum_hit = cum_look = 0
    for p in pts:
        cum_hit += p.prefix_hit_tokens
        cum_look += p.lookup_tokens
        rate.append(round(cum_hit / cum_look, 6) if cum_look else None)
    return {
        "step": [p.step for p in pts], "clock_s": [p.clock_s for p in pts],
        "free": [p.free_blocks for p in pts], "held": [p.held_blocks for p in pts],
        "cached": [p.cached_blocks for p in pts],
        "waiting": [p.waiting for p in pts], "running": [p.running for p in pts],
        "prefill": [p.prefill_tokens for p in pts], "decode": [p.decode_tokens for p in pts],
        "drafts": [p.draft_tokens for p in pts],
        "preemptions": [p.preemptions or None for p in pts],  # a marker only where some happened
        "victims": [", ".join(p.victims) or "-" for p in pts],
        "hit_rate": rate,
        "step_hit_rate": [round(p.prefix_hit_tokens / p.lookup_tokens, 6) if p.lookup_tokens else None
                          for p in pts],
        "acceptance": [round(p.accepted_drafts / p.verified_drafts, 6) if p.verified_drafts else None
                       for p in pts],
        "kv_loads": [p.kv_loads for p in pts], "failed_kv_loads": [p.failed_kv_loads for p in pts],
    }


# (panel row, column key, label, kind) of every timeline trace of one run.
_TRACES = ((1, "free", "free blocks", "line"), (1, "held", "held blocks", "line"),
           (1, "cached", "cached free blocks", "line"),
           (2, "waiting", "waiting", "line"), (2, "running", "running", "line"),
           (3, "prefill", "prefill tokens", "stack"), (3, "decode", "decode tokens", "stack"),
           (3, "drafts", "draft tokens", "stack"),
           (4, "preemptions", "preemptions", "marker"),
           (5, "hit_rate", "prefix hit rate (cumulative)", "line"),
           (5, "step_hit_rate", "prefix hit rate (admissions of the step)", "marker"),
           (5, "acceptance", "draft acceptance (step)", "marker"),
           (6, "kv_loads", "remote KV loads started", "bar"), (6, "failed_kv_loads", "failed KV loads", "bar"))


def _timeline(a: Series, b: Series | None, divergence: Divergence | None) -> go.Figure:
    fig = make_subplots(rows=len(PANELS), cols=1, shared_xaxes=True, vertical_spacing=0.03,
                        subplot_titles=[t for t, _ in PANELS])
    xs: dict[str, list[list[Any]]] = {"step": [], "clock_s": []}
    runs = [("A", a, "solid")] + ([("B", b, "dash")] if b is not None else [])
    for tag, series, dash in runs:
        cols = _columns(series)
        hover_x = [f"step {s}, t={c:.4f} s" for s, c in zip(cols["step"], cols["clock_s"])]
        for row, key, label, kind in _TRACES:
            name = f"{label} ({tag})" if b is not None else label
            common: dict[str, Any] = {"x": cols["step"], "y": cols[key], "name": name,
                                      "legend": "legend" if row == 1 else f"legend{row}",
                                      "customdata": hover_x}
            tip = "%{customdata}<br>" + label + ": %{y}"
            if key == "preemptions":
                common["text"] = cols["victims"]
                tip += "<br>victims: %{text}"
            common["hovertemplate"] = tip + "<extra></extra>"
            if kind == "bar":
                trace = go.Bar(**common, opacity=0.85 if tag == "A" else 0.5)
            elif kind == "marker":
                trace = go.Scatter(**common, mode="markers", marker={"size": 4 if key != "preemptions" else 8})
            elif kind == "stack":  # stacked areas: readable at any number of steps, unlike bars
                trace = go.Scatter(**common, mode="lines", stackgroup=f"tokens{tag}",
                                   line={"width": 0.5, "dash": dash, "shape": "hv"})
            else:  # cached free blocks are part of the free ones: dotted, so both show
                trace = go.Scatter(**common, mode="lines", line={"dash": "dot" if key == "cached" else dash,
                                                                   "shape": "hv"})
            fig.add_trace(trace, row=row, col=1)
            xs["step"].append(cols["step"])
            xs["clock_s"].append(cols["clock_s"])
    # Violations: a marker per witness on the first panel, its witness on hover.
    marks = _marks(a, divergence, b)
    if marks:
        clock = {p.step: p.clock_s for p in a.steps}
        top = max([p.free_blocks + p.held_blocks for p in a.steps] + [1])
        steps = [m[0] for m in marks]
        fig.add_trace(go.Scatter(x=steps, y=[top] * len(marks), mode="markers", name="violations / divergence",
                                 marker={"symbol": "x", "size": 11, "color": "#b00020"},
                                 text=[m[1] for m in marks], hovertemplate="%{text}<extra></extra>"),
                      row=1, col=1)
        xs["step"].append(steps)
        xs["clock_s"].append([clock.get(s, 0.0) for s in steps])
    # One legend per panel, beside it (plotly >= 5.15).
    legends = {("legend" if i == 1 else f"legend{i}"): {
        "y": fig.layout[f"yaxis{'' if i == 1 else i}"].domain[1], "yanchor": "top", "x": 1.01,
        "traceorder": "normal"} for i in range(1, len(PANELS) + 1)}
    fig.update_layout(barmode="stack", height=1500, hovermode="x unified", **legends,
                      margin={"t": 60, "l": 60, "r": 20, "b": 40},
                      shapes=_lines(marks, {}),
                      updatemenus=[_axis_switch(xs, marks, a)])
    for i, (_, ytitle) in enumerate(PANELS, start=1):
        # Every panel counts (blocks, requests, tokens) or is a rate: never below 0.
        fig.update_yaxes(title_text=ytitle, rangemode="nonnegative", row=i, col=1)
    fig.update_xaxes(title_text="step", row=len(PANELS), col=1)
    return fig


def _marks(series: Series, divergence: Divergence | None,
           against: Series | None = None) -> list[tuple[int, str]]:
    """(step, hover text) of every violation witness (of both runs with
    ``against``: B's marked "(B)") and of the first divergence."""
    out = []
    runs = [("", series)] + ([(" (B)", against)] if against is not None else [])
    for tag, v in ((tag, v) for tag, run in runs for v in run.violations):
        inv = INVARIANTS.get(v.invariant)
        lines = [f"<b>{_e(v.invariant)}</b>{tag} at step {v.step}"
                 + (f", request {_e(v.request)}" if v.request else ""), _e(v.message)]
        if inv is not None:
            lines.append(f"rule ({inv.layer}): {_e(inv.statement)}")
        lines += [_e(h) for h in v.history[-4:]]
        out.append((v.step, "<br>".join(lines)))
    if divergence is not None:
        out.append((divergence.step, f"<b>first divergence</b> at step {divergence.step}<br>"
                    f"{_e(divergence.text)}"))
    return out


def _lines(marks: list[tuple[int, str]], x_of: dict[int, Any]) -> list[dict[str, Any]]:
    """Vertical lines across every panel at the marked steps (x in the axis' unit)."""
    seen: dict[int, None] = {}
    for step, _ in marks:
        seen.setdefault(step)
    return [{"type": "line", "xref": "x", "yref": "paper", "x0": x_of.get(s, s), "x1": x_of.get(s, s),
             "y0": 0, "y1": 1, "line": {"color": "#b00020", "width": 1, "dash": "dot"}} for s in seen]


def _axis_switch(xs: dict[str, list[list[Any]]], marks: list[tuple[int, str]], series: Series) -> dict:
    clock = {p.step: p.clock_s for p in series.steps}
    last = len(PANELS)
    by_step = [{"x": xs["step"]}, {"shapes": _lines(marks, {}), f"xaxis{last}.title.text": "step"}]
    by_time = [{"x": xs["clock_s"]},
               {"shapes": _lines(marks, clock), f"xaxis{last}.title.text": "virtual time (s)"}]
    return {"type": "buttons", "direction": "right", "x": 0, "y": 1.04, "xanchor": "left",
            "buttons": [{"label": "x: step", "method": "update", "args": by_step},
                        {"label": "x: virtual time", "method": "update", "args": by_time}]}


def _gantt(series: Series) -> go.Figure:
    """One row per request (arrival order, the first GANTT_MAX_REQUESTS), one
    horizontal bar per span, coloured by state; x is the step."""
    shown = [r.request_id for r in series.requests[:GANTT_MAX_REQUESTS]]
    keep = set(shown)
    fig = go.Figure()
    for state in STATES:
        spans = [s for s in series.spans if s.state == state and s.request_id in keep]
        fig.add_trace(go.Bar(
            y=[s.request_id for s in spans], x=[s.end_step - s.start_step for s in spans],
            base=[s.start_step for s in spans], orientation="h", name=state,
            marker={"color": STATE_COLOURS[state]},
            customdata=[[s.start_step, s.end_step, round(s.start_s, 6), round(s.end_s, 6),
                         s.scheduled_tokens, s.chunks] for s in spans],
            hovertemplate="%{y}: " + state + " steps %{customdata[0]}..%{customdata[1]} "
                          "(t %{customdata[2]}..%{customdata[3]} s)<br>scheduled tokens "
                          "%{customdata[4]} in %{customdata[5]} chunks<extra></extra>"))
    fig.update_layout(barmode="overlay", height=max(300, 60 + 14 * len(shown)),
                      margin={"t": 30, "l": 90, "r": 20, "b": 40},
                      yaxis={"categoryorder": "array", "categoryarray": shown[::-1], "type": "category"},
                      xaxis={"title": {"text": "step"}})
    return fig


def _violations(series: Series, title: str) -> str:
    vs = series.violations
    if not vs:
        return f"<h2>{title}</h2><p>None: every invariant holds.</p>"
    parts = [f"<h2>{title}</h2>"]
    if series.result.num_violations > len(vs):
        parts.append(f"<p>{series.result.num_violations} in all; the first few of each invariant "
                     f"are shown.</p>")
    for v in vs:
        inv = INVARIANTS.get(v.invariant)
        parts.append(f'<div class="violation"><b>{_e(v.invariant)}</b> at step {v.step}'
                     + (f", request {_e(v.request)}" if v.request else "") + f": {_e(v.message)}"
                     + (f"<br>rule ({_e(inv.layer)}): {_e(inv.statement)}" if inv else "")
                     + (f"<pre>{_e(chr(10).join(v.history))}</pre>" if v.history else "") + "</div>")
    return "\n".join(parts)


def figure_data(page: bytes) -> dict[str, Any]:
    """Test helper: the JSON each ``Plotly.newPlot`` call of ``page`` draws,
    by div id (``{"timeline": {"data": [...], "layout": {...}}, ...}``).
    Raises ValueError if a call cannot be parsed."""
    text = page.decode("utf-8")
    out: dict[str, Any] = {}
    decoder = json.JSONDecoder()
    pos = 0
    while True:
        i = text.find("Plotly.newPlot(", pos)
        if i < 0:
            return out
        j = text.index('"', i) + 1
        div = text[j:text.index('"', j)]
        data, end = decoder.raw_decode(text, text.index("[", j))
        layout, pos = decoder.raw_decode(text, text.index("{", end))
        out[div] = {"data": data, "layout": layout}
