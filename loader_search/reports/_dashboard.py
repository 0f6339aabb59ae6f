"""``loader-search dashboard``: optuna-dashboard on a study storage, aware of infeasible trials.

optuna-dashboard 0.21 predates Optuna 5's ``trial.set_constraint``, which stores each constraint
as a trial system attribute ``constraints:<key>``. It reads only the older list form
(``constraints``), so out of the box it treats infeasible trials (stored COMPLETE with
placeholder values) as feasible, in two places:

1. the server's ``best_trials`` (``/api/studies/<id>``, the "Best Trials" view): computed by
   ``optuna_dashboard._app.get_pareto_front_trials`` over every COMPLETE trial;
2. the browser's Pareto-front plot, which splits trials into feasible and infeasible by the
   ``constraints`` list the server sends with each trial.

The smallest fix that covers both, used only by this command and undone when it returns:

- `FeasibilityAwareStorage` wraps the storage and, on reads, adds the list form of a trial's
  constraints (Optuna's own ``trial.constraints`` values) to the trial it returns; nothing is
  written to the database;
- `feasible_pareto_front` replaces the dashboard's Pareto function, for the life of the server,
  by the same function applied to Optuna's feasible trials only, which is what Optuna's own
  ``study.best_trials`` does.

``tests/test_dashboard.py`` checks both through the dashboard's HTTP API, so an
optuna-dashboard release that changes either code path fails there, not silently.
"""

from __future__ import annotations

import contextlib
import copy
import socketserver
from collections.abc import Callable, Container, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from loader_search.errors import UserError
from loader_search.study import is_feasible

if TYPE_CHECKING:
    # Only in BaseStorage's own signatures: Optuna exports no public name for it.
    from loader_search.study import FrozenStudy

# The system attribute optuna-dashboard reads constraints from (Optuna < 5 wrote it).
_LEGACY_CONSTRAINTS_KEY = "constraints"
INSTALL_HINT = "pip install 'loader-search[dashboard]'"


class FeasibilityAwareStorage(BaseStorage):
    """A read-through view of ``storage`` whose trials also carry their constraints in the
    list form optuna-dashboard understands. Everything else is delegated unchanged."""

    def __init__(self, storage: BaseStorage) -> None:
        self._storage = storage

    @staticmethod
    def _with_constraints(trial: FrozenTrial) -> FrozenTrial:
        constraints = trial.constraints
        if not constraints or _LEGACY_CONSTRAINTS_KEY in trial.system_attrs:
            return trial
        shown = copy.copy(trial)  # never change a trial the wrapped storage may cache
        attrs = {k: v for k, v in trial.system_attrs.items() if not k.startswith("constraints:")}
        attrs[_LEGACY_CONSTRAINTS_KEY] = list(constraints.values())
        shown.system_attrs = attrs
        return shown

    # Reads that return trials: the only methods that differ from the wrapped storage.
    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self._with_constraints(self._storage.get_trial(trial_id))

    def get_all_trials(
        self,
        study_id: int,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
    ) -> list[FrozenTrial]:
        trials = self._storage.get_all_trials(study_id, deepcopy=deepcopy, states=states)
        return [self._with_constraints(t) for t in trials]

    # Delegated as they are.
    def get_all_studies(self) -> list[FrozenStudy]:
        # Sorted by id, as optuna-dashboard does for an RDBStorage (it checks the type):
        # FrozenStudy orders by study id.
        try:
            return sorted(self._storage.get_all_studies())
        except (RecursionError, ValueError):
            # A study attribute that cannot be decoded (JSON nested too deep, written by
            # other hands) must not hide every study: each is read alone, and one whose
            # attributes cannot be read is listed without them.
            return sorted(self._each_study())

    def _each_study(self) -> Iterator[FrozenStudy]:
        from loader_search.study import FrozenStudy, study_names

        for name in study_names(self._storage):
            study_id = self._storage.get_study_id_from_name(name)
            attrs: list[dict[str, Any]] = []
            for read in (self._storage.get_study_user_attrs, self._storage.get_study_system_attrs):
                try:
                    attrs.append(read(study_id))
                except (RecursionError, ValueError):
                    attrs.append({})
            yield FrozenStudy(
                study_name=name,
                direction=None,
                directions=self._storage.get_study_directions(study_id),
                user_attrs=attrs[0],
                system_attrs=attrs[1],
                study_id=study_id,
            )

    def create_new_study(
        self, directions: Sequence[StudyDirection], study_name: str | None = None
    ) -> int:
        return self._storage.create_new_study(directions, study_name)

    def delete_study(self, study_id: int) -> None:
        self._storage.delete_study(study_id)

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._storage.set_study_user_attr(study_id, key, value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._storage.set_study_system_attr(study_id, key, value)

    def get_study_id_from_name(self, study_name: str) -> int:
        return self._storage.get_study_id_from_name(study_name)

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._storage.get_study_name_from_id(study_id)

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self._storage.get_study_directions(study_id)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._storage.get_study_user_attrs(study_id)

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._storage.get_study_system_attrs(study_id)

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        return self._storage.create_new_trial(study_id, template_trial)

    def set_trial_param(
        self,
        trial_id: int,
        param_name: str,
        param_value_internal: float,
        distribution: BaseDistribution,
    ) -> None:
        self._storage.set_trial_param(trial_id, param_name, param_value_internal, distribution)

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        return self._storage.set_trial_state_values(trial_id, state, values)

    def set_trial_intermediate_value(
        self, trial_id: int, step: int, intermediate_value: float
    ) -> None:
        self._storage.set_trial_intermediate_value(trial_id, step, intermediate_value)

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._storage.set_trial_user_attr(trial_id, key, value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._storage.set_trial_system_attr(trial_id, key, value)


@contextmanager
def feasible_pareto_front() -> Iterator[None]:
    """While active, optuna-dashboard's Pareto front (its ``best_trials``) is computed over
    feasible trials only, as Optuna's ``study.best_trials`` is."""
    from optuna_dashboard import _app

    original = getattr(_app, "get_pareto_front_trials", None)
    if original is None:
        import optuna_dashboard

        raise UserError(
            f"optuna-dashboard {optuna_dashboard.__version__} is not supported (its Pareto"
            " front code moved): pip install 'optuna-dashboard>=0.21,<0.22'"
        )

    def feasible_only(
        trials: Sequence[FrozenTrial], directions: Sequence[StudyDirection]
    ) -> list[FrozenTrial]:
        feasible = [t for t in trials if t.state == TrialState.COMPLETE and is_feasible(t)]
        return list(original(feasible, directions))

    _app.get_pareto_front_trials = feasible_only
    try:
        yield
    finally:
        _app.get_pareto_front_trials = original


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    """The dashboard's page fires several API requests at once: serve them in parallel."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No line per request on stderr: the dashboard polls every few seconds."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY_ADDRESS = frozenset({"0.0.0.0", "::", ""})


def host_checked(app: Any, host: str, allowed_hosts: Sequence[str] = ()) -> Any:
    """``app`` answering only requests addressed to the host it is bound to (and, bound to
    loopback, to its other loopback names): a web page elsewhere that points its own host
    name at 127.0.0.1 (DNS rebinding) gets 403 instead of the studies. Bound to every
    address (``--host 0.0.0.0``), the operator chose to expose it: any Host is served, unless
    ``allowed_hosts`` names the ones to serve (a container publishes its port on the host's
    127.0.0.1, but must listen on 0.0.0.0 inside)."""
    if allowed_hosts:
        allowed = {name.strip("[]").lower() for name in allowed_hosts}
    elif host in ANY_ADDRESS:
        return app
    else:
        allowed = {host.strip("[]").lower()}
    if allowed & LOOPBACK_NAMES:
        allowed |= LOOPBACK_NAMES

    def checked(environ: dict[str, Any], start_response: Any) -> Any:
        requested = environ.get("HTTP_HOST", "")
        name = requested.rsplit(":", 1)[0] if not requested.endswith("]") else requested
        if name.strip("[]").lower() not in allowed:
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"loader-search dashboard: unknown Host header\n"]
        return app(environ, start_response)

    return checked


def serve(
    storage: BaseStorage,
    host: str,
    port: int,
    on_ready: Callable[[str], None] = lambda url: None,
    allowed_hosts: Sequence[str] = (),
) -> None:
    """Serve optuna-dashboard for ``storage`` on ``host:port`` until Ctrl-C.

    ``on_ready`` gets the dashboard's URL once the port is bound (``port=0`` picks a free
    one); ``allowed_hosts``: the Host headers it answers (see `host_checked`). Ctrl-C stops
    the server and returns normally.
    """
    try:
        import optuna_dashboard
    except ModuleNotFoundError:
        raise UserError(f"the dashboard needs optuna-dashboard: {INSTALL_HINT}") from None

    view = FeasibilityAwareStorage(storage)
    with feasible_pareto_front():
        app = host_checked(optuna_dashboard.wsgi(view), host, allowed_hosts)
        try:
            server = make_server(
                host, port, app, server_class=_ThreadingServer, handler_class=_QuietHandler
            )
        except OSError as exc:
            raise UserError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port"
                " (or --host)"
            ) from None
        with server:
            bound_port = server.server_address[1]
            on_ready(f"http://{host}:{bound_port}/dashboard/")
            # Ctrl-C is how a user stops it: not an error.
            with contextlib.suppress(KeyboardInterrupt):
                server.serve_forever()
