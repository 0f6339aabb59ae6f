"""The worker loop: the session a worker runs (`Session`), taking the next trial under the
study lock and the budget decision behind it, planning a trial from the ones before it,
running it, recording its outcome in Optuna, the heartbeats and sweeper that keep a team's
trials honest, and this machine as a study sees it (pinning, hardware class).

Callers outside this folder import from ``loader_search.study.work``. Names load lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loader_search._faces import lazy

_EXPORTS = {
    # the session and the loop
    "Session": "loader_search.study.work._session_state",
    "work": "loader_search.study.work._worker",
    "count_finished": "loader_search.study.work._worker",
    "fresh_recipe": "loader_search.study.work._plan",
    # the budget decision, and taking a trial
    "decide": "loader_search.study.work._budget",
    "Decision": "loader_search.study.work._budget",
    "Take": "loader_search.study.work._budget",
    "Wait": "loader_search.study.work._budget",
    "Confirm": "loader_search.study.work._budget",
    "Done": "loader_search.study.work._budget",
    "count_used": "loader_search.study.work._budget",
    "uses_budget": "loader_search.study.work._budget",
    "confirm_settings": "loader_search.study.work._budget",
    "FINISHED_STATES": "loader_search.study.work._budget",
    "queue_decision": "loader_search.study.work._take",
    # planning and recording a trial
    "plan_trial": "loader_search.study.work._plan",
    "Reuse": "loader_search.study.work._plan",
    "record": "loader_search.study.work._record",
    "write_user_attrs": "loader_search.study.work._trials",
    # heartbeats
    "RetryStaleTrial": "loader_search.study.work._heartbeats",
    # this machine
    "Machine": "loader_search.study.work._machine",
    "this_machine": "loader_search.study.work._machine",
    "check_hardware": "loader_search.study.work._machine",
    "fit_to_machine": "loader_search.study.work._machine",
    # a command's space, narrowed by a first look at it
    "command_space": "loader_search.study.work._script",
    "SCRIPT_FACTS_ATTR": "loader_search.study.work._script",
    "hardware_mismatch": "loader_search.study.work._machine",
    "TIMINGS_ENV": "loader_search.study.work._timings",
}

__all__ = [
    "FINISHED_STATES",
    "SCRIPT_FACTS_ATTR",
    "TIMINGS_ENV",
    "Confirm",
    "Decision",
    "Done",
    "Machine",
    "RetryStaleTrial",
    "Reuse",
    "Session",
    "Take",
    "Wait",
    "check_hardware",
    "command_space",
    "confirm_settings",
    "count_finished",
    "count_used",
    "decide",
    "fit_to_machine",
    "fresh_recipe",
    "hardware_mismatch",
    "plan_trial",
    "queue_decision",
    "record",
    "this_machine",
    "uses_budget",
    "work",
    "write_user_attrs",
]

if TYPE_CHECKING:
    from loader_search.study.work._budget import (
        FINISHED_STATES,
        Confirm,
        Decision,
        Done,
        Take,
        Wait,
        confirm_settings,
        count_used,
        decide,
        uses_budget,
    )
    from loader_search.study.work._heartbeats import RetryStaleTrial
    from loader_search.study.work._machine import (
        Machine,
        check_hardware,
        fit_to_machine,
        hardware_mismatch,
        this_machine,
    )
    from loader_search.study.work._plan import Reuse, fresh_recipe, plan_trial
    from loader_search.study.work._record import record
    from loader_search.study.work._script import SCRIPT_FACTS_ATTR, command_space
    from loader_search.study.work._session_state import Session
    from loader_search.study.work._take import queue_decision
    from loader_search.study.work._timings import TIMINGS_ENV
    from loader_search.study.work._trials import write_user_attrs
    from loader_search.study.work._worker import count_finished, work


__getattr__ = lazy(__name__, _EXPORTS)
