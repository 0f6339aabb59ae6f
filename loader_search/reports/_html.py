"""Drawing the report: one self-contained HTML file from a `ReportData`.

Nothing is computed here that a test would need to check; `loader_search.reports._collect` does
that. The figures are drawn in `loader_search.reports._figures`; plotly's own
``Figure.to_html`` writes each one's container and drawing script, and this module only adds
the text around them.

The file works offline: plotly.js (`plotly.offline.get_plotlyjs`) is embedded once, inline, in
the head, and the page loads nothing else (no CDN, no MathJax, no fonts, no images), so it can
be mailed or archived as is. The plotly.js bundle itself contains URL strings (map tiles for
map traces, which this report never draws); the browser test checks that opening the file makes
no request at all.

When every plot has been drawn the page sets ``data-report-status="ok"`` on ``<body>``
(``error: ...`` on a JavaScript error), which the browser test reads.
"""

from __future__ import annotations

import html
import json
import re

from plotly.offline import get_plotlyjs

from loader_search.reports._data import ReportData
from loader_search.reports._figures import figures
from loader_search.study import StudySummary, critical_batch_text

# Plot ids, in page order; the browser test expects each container to hold a drawn plot.
PLOT_IDS = (
    "plot-pareto",
    "plot-hypervolume",
    "plot-importances",
    "plot-throughput-grid",
    "plot-data-wait",
    "plot-efficiency",
    "plot-memory",
)
# No plotly.com link or logo: nothing that leaves the page. (plotly.js 3 has no "edit in
# Chart Studio" link any more; plotly 6+ warns about its ``showLink`` option.)
_PLOT_CONFIG = {"displaylogo": False, "responsive": True, "topojsonURL": ""}


def render(data: ReportData) -> str:
    """The whole report as one HTML document."""
    plots = {
        plot_id: fig.to_html(
            full_html=False,
            include_plotlyjs=False,  # once, in the head
            div_id=plot_id,
            config=_PLOT_CONFIG,
            post_script="window.reportDrawn('{plot_id}');",
        )
        for plot_id, fig in figures(data).items()
    }
    title = f"loader-search report: {data.study}"
    hv = data.hypervolume
    reference = f" (here {hv.reference_val_loss:.4g})" if hv.reference_val_loss is not None else ""
    sections = [
        _header(data),
        _recommendation(data),
        _section(
            "Pareto front: throughput against validation loss",
            _pareto_note(data),
            plots["plot-pareto"],
        ),
        _section(
            "Hypervolume history",
            f"Higher is better; it can only grow. {hv.rule}{reference}.",
            plots["plot-hypervolume"],
        ),
        _section(
            "Parameter importances",
            " ".join(f"{i.objective}: {i.note}." for i in data.importances),
            plots["plot-importances"],
        ),
        _section(
            "Throughput by num_workers x prefetch_factor, for each batch size",
            "Median samples/s of the feasible trials with those settings (others pooled);"
            " the number of trials is in brackets.",
            plots["plot-throughput-grid"],
        ),
        _section(
            "Data-wait fraction per trial",
            "Share of the measured window the training loop spent waiting for the next batch."
            f" Above {data.input_bound_threshold:.0%}: input-bound (the loader set the pace),"
            " else compute-bound. A diagnostic, never the score.",
            plots["plot-data-wait"],
        ),
        _section(
            "Loader efficiency per trial",
            "Throughput divided by the ceiling: the same model and batch size trained on"
            " pre-decoded batches already on the device, which no loader setting can beat."
            " Near 100% the loader no longer limits training; far below, the model waits for"
            " data.",
            plots["plot-efficiency"],
        ),
        _section("Peak memory against batch size", _memory_note(data), plots["plot-memory"]),
        _failures(data),
        _hardware(data),
    ]
    return _PAGE.format(
        title=html.escape(title),
        style=_STYLE,
        plot_ids=json.dumps(list(PLOT_IDS)),
        plotlyjs=get_plotlyjs().replace("</script", "<\\/script"),
        body="\n".join(sections),
    )


# --- the text around the plots -----------------------------------------------------------


def _section(title: str, note: str, figure: str) -> str:
    return (
        f'<section><h2>{html.escape(title)}</h2><p class="note">{_note_html(note)}</p>'
        f'<div class="plot">{figure}</div></section>'
    )


def _note_html(text: str) -> str:
    """A plain-text note as HTML: escaped, with `backticked` spans (commands, names) shown
    as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _header(data: ReportData) -> str:
    s = data.summary
    counts = (
        f"{s.n_complete} complete (feasible), {s.n_infeasible} infeasible, {s.n_failed} failed"
        + (f", {s.n_running} running" if s.n_running else "")
    )
    return (
        f"<header><h1>{html.escape(data.study)}</h1>"
        f'<p class="note">loader-search report, generated {html.escape(data.generated_at)}.'
        f" Trials: {html.escape(counts)}. Objectives: {html.escape(data.metric_names[0])}"
        f" (maximised), {html.escape(data.metric_names[1])} (minimised).</p></header>"
    )


def _recommendation(data: ReportData) -> str:
    s = data.summary
    base, rec = s.baseline, s.recommended
    rows = []
    if base is not None:
        measured = ""
        if base.measurements:
            measured = f" (median of {len(base.measurements)} trials)"
        rows.append(
            f"<tr><th>Baseline</th><td>trial #{base.number},"
            f" {html.escape(base.params.describe())}: {base.throughput:,.0f} samples/s{measured},"
            f" val_loss {base.val_loss:.4f}</td></tr>"
        )
    if s.baseline_doubt is not None:
        rows.append(
            f"<tr><th>Warning</th><td>{html.escape(s.baseline_doubt)}; the loss tolerance is"
            " applied to the best val_loss of the study instead</td></tr>"
        )
    if rec is None:
        body = "<p>No completed feasible trial yet: nothing to recommend.</p>"
        return f"<section><h2>Recommendation</h2>{body}</section>"
    p = rec.point
    verdict = (
        f"trial #{p.number}, {html.escape(p.params.describe())}: {p.throughput:,.0f} samples/s"
    )
    if rec.keeps_baseline:  # the verdict's word: no trial is called recommended then
        which = f" (trial #{base.number})" if base is not None else ""
        verdict = f"keep the baseline{which}: " + (
            "no faster setting within the loss tolerance was found; try more trials"
            if p.is_baseline
            else "no candidate was surely faster in the paired rounds"
        )
    rows.append(f"<tr><th>Recommended</th><td>{verdict}</td></tr>")
    speedup = rec.speedup_text()
    if p.is_baseline:
        rows.append("<tr><th>Speedup</th><td>none: the baseline is the recommendation</td></tr>")
    elif speedup is not None:
        rows.append(f"<tr><th>Speedup</th><td><b>{html.escape(speedup)}</b></td></tr>")
    # A rejected candidate's code is shown only as one to try anyway: measured faster.
    snippet = rec.snippet
    if rec.keeps_baseline and not p.is_baseline:
        tried = "none: the best candidate was measured slower than the baseline"
        if rec.worth_trying is not None:
            tried = f"the best candidate, trial #{p.number}, {html.escape(p.params.describe())}"
        else:
            snippet = ""
        rows.append(f"<tr><th>Try it anyway?</th><td>{tried}</td></tr>")
    elif rec.val_loss_change_vs_baseline is not None:
        rows.append(
            f"<tr><th>val_loss</th><td>{p.val_loss:.4f}"
            f" ({rec.val_loss_change_vs_baseline:+.1%} vs baseline)</td></tr>"
        )
    rows.append(f"<tr><th>Rule</th><td>{html.escape(rec.rule)}</td></tr>")
    rows += _goodput_rows(s)
    return (
        '<section id="recommendation"><h2>Recommendation</h2>'
        f'<table class="kv">{"".join(rows)}</table>'
        + (f"<pre><code>{html.escape(snippet)}</code></pre>" if snippet else "")
        + "</section>"
    )


def _goodput_rows(s: StudySummary) -> list[str]:
    """The study's gradient noise scale in words, and each front setting's goodput."""
    if s.noise is None:
        return []
    rows = [f"<tr><th>Noise scale</th><td>{html.escape(critical_batch_text(s.noise))}</td></tr>"]
    if s.baseline is not None and s.baseline.throughput > 0:
        shown = ", ".join(
            f"#{p.number} (batch {p.params.batch_size}) {goodput / s.baseline.throughput:.2f}x"
            for p in s.pareto
            if (goodput := s.goodput(p)) is not None
        )
        rows.append(
            "<tr><th>Goodput</th><td>samples/s times the statistical efficiency of the batch"
            " size against the baseline's, as a multiple of the baseline's (its loss that much"
            f" sooner): {html.escape(shown)}</td></tr>"
        )
    return rows


def _pareto_note(data: ReportData) -> str:
    n = len(data.summary.pareto)
    unplotted = sum(t.status in ("infeasible", "failed") for t in data.trials)
    note = (
        f"{n} Pareto-optimal setting(s): as in `best` and `studies`, the"
        " trials that ran one setting are one point at the median of their readings (the faint"
        " dots are the single readings). Optuna's own views (optuna-dashboard, `optuna"
        " best-trials`) compute the front over raw trials, repeats not merged:"
        f" {data.optuna_front_trials} trial(s) there. Dominated settings in grey; the baseline"
        " boxed, the recommendation starred."
    )
    if unplotted:
        note += (
            " Infeasible and failed trials have no measured objective values (an infeasible"
            " trial's stored values are placeholders), so they are listed below the front."
        )
    return note


def _memory_note(data: ReportData) -> str:
    m = data.memory
    note = (
        "Peak resident memory of the training process and its loader workers (an upper bound:"
        " pages shared after fork count once per process); GPU memory on CUDA."
    )
    if m.smallest_oom_batch_size is None:
        return note + " No trial ran out of memory."
    largest = (
        f"; largest batch size that ran: {m.largest_ok_batch_size}"
        if m.largest_ok_batch_size
        else ""
    )
    return (
        note + f" Out of memory from batch size {m.smallest_oom_batch_size}"
        f" (trials {', '.join(f'#{n}' for n in m.oom_trials)}){largest}."
    )


def _failures(data: ReportData) -> str:
    if not data.failures:
        return "<section><h2>Failures</h2><p>No trial failed or was infeasible.</p></section>"
    rows = "".join(
        f"<tr><td>{html.escape(g.reason)}</td><td>{len(g.trials)}</td>"
        f"<td>{', '.join(f'#{n}' for n in g.trials)}</td>"
        f"<td>{', '.join(f'#{n}' for n in g.infeasible) or '-'}</td>"
        f"<td>{html.escape(g.message or '')}</td><td>{html.escape(g.hint or '')}</td></tr>"
        for g in data.failures
    )
    return (
        '<section id="failures"><h2>Failures, by reason</h2><table class="grid"><tr><th>reason'
        "</th><th>trials</th><th>which</th><th>of them infeasible</th><th>first message</th>"
        f"<th>hint</th></tr>{rows}</table></section>"
    )


def _hardware(data: ReportData) -> str:
    parts = []
    for group in data.hardware:
        details = "".join(
            f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
            for k, v in group.details
        )
        parts.append(
            f"<h3>{html.escape(group.hardware_class or 'unnamed hardware')}:"
            f' {len(group.trials)} trial(s)</h3><table class="kv">{details}</table>'
        )
    if not parts:
        parts.append(
            "<p>The trials carry no hardware fingerprint (recorded by newer versions).</p>"
        )
    if data.environment:
        env = "".join(
            f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
            for k, v in data.environment
        )
        parts.append(f'<h3>Recorded with the study</h3><table class="kv">{env}</table>')
    return f'<section id="hardware"><h2>Hardware</h2>{"".join(parts)}</section>'


_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto;
       max-width: 1280px; padding: 0 24px 48px; color: #1d2733; }
h1 { margin: 24px 0 4px; } h2 { margin: 32px 0 4px; border-bottom: 1px solid #dde3ea; }
.note { color: #52606d; margin: 4px 0 8px; }
.plot { min-height: 300px; }
pre { background: #f4f6f8; padding: 12px 16px; border-radius: 6px; overflow-x: auto; }
table { border-collapse: collapse; } th, td { text-align: left; padding: 3px 10px; }
table.grid td, table.grid th { border: 1px solid #dde3ea; }
table.kv th { color: #52606d; font-weight: 600; }
"""

# The status script comes first, so that it sees errors from the first script on, before
# plotly.js is even parsed; each plot's script (plotly's) calls reportDrawn once it is drawn.
_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<script>
(function () {{
  var errors = [], pending = {plot_ids};
  function settle() {{
    if (!document.body) {{ return; }}
    if (errors.length) {{
      document.body.setAttribute("data-report-status", "error: " + errors.join("; "));
    }} else if (!pending.length) {{
      document.body.setAttribute("data-report-status", "ok");
    }}
  }}
  window.addEventListener("error", function (e) {{ errors.push(String(e.message)); settle(); }});
  window.addEventListener("unhandledrejection", function (e) {{
    errors.push(String(e.reason && e.reason.message || e.reason));
    settle();
  }});
  window.reportDrawn = function (id) {{
    pending = pending.filter(function (p) {{ return p !== id; }});
    settle();
  }};
}})();
</script>
<style>{style}</style>
<script>{plotlyjs}</script>
</head>
<body data-report-status="loading">
{body}
</body>
</html>
"""
