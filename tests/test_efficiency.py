"""A loader efficiency reads the same wherever a person reads it: a value above 100% (the trial
beat the model fed pre-decoded data, so the ceiling reading was low) is marked with ``!`` in
the live progress line, the plain progress lines, the summary table and the recommendation."""

from __future__ import annotations

import io

from rich.console import Console

from loader_search.cli._console import RichReporter
from loader_search.cli._summary import _efficiency
from loader_search.params import LoaderParams
from loader_search.study import LineReporter, TrialEvent, efficiency_text


def _event(efficiency: float | None) -> TrialEvent:
    return TrialEvent(
        number=7,
        params=LoaderParams(batch_size=32),
        state="complete",
        throughput=1234.0,
        val_loss=0.5,
        failure=None,
        hint=None,
        duration_s=1.5,
        finished=3,
        budget=10,
        pareto_size=1,
        best_throughput=1234.0,
        best_val_loss=0.5,
        loader_efficiency=efficiency,
    )


def _progress_line(efficiency: float | None) -> str:
    out = io.StringIO()
    RichReporter(Console(file=out, width=200, color_system=None)).trial_finished(
        _event(efficiency)
    )
    return out.getvalue()


def _plain_line(efficiency: float | None) -> str:
    out = io.StringIO()
    LineReporter(out).trial_finished(_event(efficiency))
    return out.getvalue()


def test_one_rule_marks_a_value_from_a_low_ceiling() -> None:
    assert efficiency_text(0.87) == "87%"
    assert efficiency_text(1.0) == "100%"
    assert efficiency_text(1.08) == "108%!"
    assert efficiency_text(7.04) == "704%!"


def test_the_progress_line_marks_an_efficiency_above_the_ceiling() -> None:
    assert "eff 108%!" in _progress_line(1.08)
    assert "eff 704%!" in _progress_line(7.04)
    line = _progress_line(0.87)
    assert "eff  87%" in line and "!" not in line
    assert "eff" not in _progress_line(None)


def test_every_place_that_shows_an_efficiency_follows_the_rule() -> None:
    for value in (0.87, 1.08, 7.04):
        shown = efficiency_text(value)
        assert f"efficiency {shown}," in _plain_line(value)
        assert _efficiency(value) == shown
    assert _efficiency(None) == "-"
