"""The benchmark suite's metrics on hand-made tables whose answers are known: no training.

Each expected value is worked out by hand in the test, so a bug in a metric (the hypervolume,
the regret's boundary, the ground truth's medians and costs, the replay table's statistics)
fails here rather than shifting a figure in benchmarks/RESULTS.md unnoticed.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from benchmarks import cli
from benchmarks.ground_truth import (
    FULL_SPACE,
    QUICK_SPACE,
    REGIMES,
    STANDIN_SPACE,
    Entry,
    Space,
    aggregate,
)
from benchmarks.replay import (
    BASE_VARIANT,
    EQUAL_LOSS,
    Run,
    Truth,
    Variant,
    _Replay,
    _to_table,
    replay_one,
    table,
    trials_to_5pct,
)
from loader_search.params import LoaderParams, TrainingSettings
from loader_search.study import (
    CEILING_ATTR,
    CONFIRM_ROUND_ATTR,
    CONFIRMATION_ATTR,
    PARAMS_ATTR,
    VAL_LOSS_FROM,
    SamplerConfig,
    default_torch_threads,
    load_config,
    summarize_trials,
)

# QUICK_SPACE.configs(): batch 32 and 64, each without workers and with one worker.
B32_W0, B32_W1, B64_W0, B64_W1 = QUICK_SPACE.configs()
TRAINING = TrainingSettings(train_samples=1024, batch_size=32)


@pytest.fixture(autouse=True)
def _quiet_optuna() -> Iterator[None]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def entry(
    params: LoaderParams,
    throughput: float,
    val_loss: float,
    *,
    throughputs: tuple[float, ...] | None = None,
    val_losses: tuple[float, ...] | None = None,
    wall_s: float = 1.0,
    short_wall_s: float = 0.5,
    ceiling_wall_s: float = 0.0,
) -> Entry:
    throughputs = throughputs or (throughput,)
    return Entry(
        params=params,
        throughput=throughput,
        throughputs=throughputs,
        val_loss=val_loss,
        val_losses=val_losses or (val_loss,) * len(throughputs),
        full_window_throughputs=throughputs,
        wall_s=wall_s,
        short_wall_s=short_wall_s,
        train_time_s=wall_s / 2,
        ceiling=1000.0,
        ceiling_wall_s=ceiling_wall_s,
    )


# --- Truth: hypervolume gap and regret ---------------------------------------------------


def test_hv_gap_matches_a_hand_computed_hypervolume() -> None:
    # Normalised (throughput / 100, (val_loss - 1) / 1): A (0.4, 0), B (0.8, 0), C (0.6, 1),
    # D (1.0, 1). Reference (0, 1.1); the area dominated is the union of [0, t] x [v, 1.1].
    truth = Truth.of(
        [
            entry(B32_W0, 40, 1.0),  # A
            entry(B32_W1, 80, 1.0),  # B
            entry(B64_W0, 60, 2.0),  # C
            entry(B64_W1, 100, 2.0),  # D
        ]
    )
    # True front B, D: 0.8 x 1.1 + (1.0 - 0.8) x (1.1 - 1) = 0.88 + 0.02.
    assert truth.true_hv == pytest.approx(0.90)
    # {A, C}: 0.4 x 1.1 + (0.6 - 0.4) x 0.1 = 0.46.
    assert truth.hypervolume([B32_W0, B64_W0]) == pytest.approx(0.46)
    assert truth.hv_gap([B32_W0, B64_W0]) == pytest.approx(1 - 0.46 / 0.90)
    assert truth.hv_gap([B32_W1]) == pytest.approx(1 - 0.88 / 0.90)
    assert truth.hv_gap([B64_W1]) == pytest.approx(1 - 0.10 / 0.90)
    assert truth.hv_gap([B32_W1, B64_W1, B32_W0]) == pytest.approx(0.0)  # dominated: no gain
    assert truth.hv_gap([]) == 1.0


def test_regret_counts_losses_within_equal_loss_as_equal_and_no_further() -> None:
    chosen = entry(B32_W0, 50, 1.0)
    at_boundary = Truth.of([chosen, entry(B32_W1, 100, 1.0 * (1 + EQUAL_LOSS))])
    # Equal loss (at the boundary) and twice as fast: the choice lost half.
    assert at_boundary.regret(B32_W0) == pytest.approx(0.5)
    assert at_boundary.regret(B32_W1) == 0.0
    beyond = Truth.of([chosen, entry(B32_W1, 100, 1.0 * (1 + EQUAL_LOSS) * (1 + 1e-9))])
    assert beyond.regret(B32_W0) == 0.0  # a worse loss: not a better choice
    # A better loss always counts, however much better.
    better = Truth.of([chosen, entry(B32_W1, 80, 0.5)])
    assert better.regret(B32_W0) == pytest.approx(1 - 50 / 80)
    assert better.regret(B32_W1) == 0.0


def test_truth_ceiling_cost_is_the_median_per_batch_size_and_threads() -> None:
    truth = Truth.of(
        [
            entry(B32_W0, 1, 1.0, ceiling_wall_s=0.8),
            entry(B32_W1, 1, 1.0, ceiling_wall_s=0.0),
            entry(B64_W0, 1, 1.0, ceiling_wall_s=0.3),
            entry(B64_W1, 1, 1.0, ceiling_wall_s=0.5),
            entry(dataclasses.replace(B64_W1, torch_threads=2), 1, 1.0, ceiling_wall_s=2.0),
        ]
    )
    assert truth.ceiling_wall_s == pytest.approx({(32, 1): 0.4, (64, 1): 0.4, (64, 2): 2.0})


def test_prefetch_step_k_maps_to_the_tables_kth_value() -> None:
    for step, value in enumerate(FULL_SPACE.prefetch, start=1):
        params = LoaderParams(64, 2, step, False, True, 1)
        assert _to_table(params, FULL_SPACE) == LoaderParams(64, 2, value, False, True, 1)
    odd = Space((32,), (0, 1), (2, 8), (False,), (1,))
    assert _to_table(LoaderParams(32, 1, 1), odd).prefetch_factor == 2
    assert _to_table(LoaderParams(32, 1, 2), odd).prefetch_factor == 8
    assert _to_table(LoaderParams(32, 0), odd) == LoaderParams(32, 0)


# --- ground_truth.aggregate ----------------------------------------------------------------


def row(params: LoaderParams, repeat: int, **values: Any) -> dict[str, Any]:
    from benchmarks.ground_truth import key

    base = {"config": key(params), "params": params.as_dict(), "repeat": repeat, "ceiling": None}
    return base | values


def test_aggregate_medians_short_wall_and_ceiling_wall() -> None:
    rows = [
        # B32_W0: repeat 0 measured the ceiling (its wall time includes the reading).
        row(B32_W0, 0, throughput=100.0, full_window_throughput=90.0, val_loss=1.0,
            wall_s=3.0, short_train_time_s=0.5, train_time_s=1.0, eval_time_s=0.2,
            ceiling=1000.0),
        row(B32_W0, 1, throughput=120.0, full_window_throughput=110.0, val_loss=1.2,
            wall_s=2.0, short_train_time_s=0.6, train_time_s=1.2, eval_time_s=0.3),
        row(B32_W0, 2, throughput=80.0, full_window_throughput=100.0, val_loss=1.1,
            wall_s=2.4, short_train_time_s=0.4, train_time_s=1.0, eval_time_s=0.2),
        # B32_W1: its ceiling run happened to be faster than the others: no negative cost.
        row(B32_W1, 0, throughput=200.0, full_window_throughput=190.0, val_loss=1.0,
            wall_s=1.0, short_train_time_s=0.3, train_time_s=0.6, eval_time_s=0.1,
            ceiling=1200.0),
        row(B32_W1, 1, throughput=210.0, full_window_throughput=200.0, val_loss=1.0,
            wall_s=1.5, short_train_time_s=0.3, train_time_s=0.6, eval_time_s=0.1),
        row(B32_W1, 2, throughput=190.0, full_window_throughput=180.0, val_loss=1.0,
            wall_s=1.7, short_train_time_s=0.3, train_time_s=0.6, eval_time_s=0.1),
        # B64_W0 failed once: not in the table.
        row(B64_W0, 0, throughput=50.0, full_window_throughput=50.0, val_loss=2.0,
            wall_s=1.0, short_train_time_s=0.3, train_time_s=0.6, eval_time_s=0.1,
            ceiling=900.0),
        row(B64_W0, 1, wall_s=0.1, failure="oom: out of memory"),
    ]  # fmt: skip
    entries = {e.params: e for e in aggregate(rows)}
    assert set(entries) == {B32_W0, B32_W1}
    first = entries[B32_W0]
    assert first.throughput == 100.0 and first.throughputs == (100.0, 120.0, 80.0)
    assert first.val_loss == pytest.approx(1.1) and first.val_losses == (1.0, 1.2, 1.1)
    assert first.full_window_throughputs == (90.0, 110.0, 100.0)
    assert first.wall_s == pytest.approx(2.2)  # the runs without the ceiling: 2.0, 2.4
    # short_train + wall - train - eval, of the runs without the ceiling: 1.1 and 1.6.
    assert first.short_wall_s == pytest.approx(1.35)
    assert first.train_time_s == pytest.approx(1.0)
    assert first.ceiling_wall_s == pytest.approx(3.0 - 2.2)
    assert first.ceiling == pytest.approx(1100.0)  # median of the pair's readings
    second = entries[B32_W1]
    assert second.wall_s == pytest.approx(1.6)
    assert second.short_wall_s == pytest.approx(1.2)  # 0.3 + 1.5 - 0.7 and 0.3 + 1.7 - 0.7
    assert second.ceiling_wall_s == 0.0
    assert second.ceiling == pytest.approx(1100.0)


def test_entry_round_trips_and_reads_tables_without_ceiling_wall() -> None:
    original = entry(B64_W1, 300, 1.5, throughputs=(290.0, 300.0), ceiling_wall_s=0.7)
    data = original.as_dict()
    assert data["ceiling_wall_s"] == 0.7
    assert Entry.from_dict(data) == original
    del data["ceiling_wall_s"]  # a table written before the field existed
    assert Entry.from_dict(data) == dataclasses.replace(original, ceiling_wall_s=0.0)


# --- replay.table --------------------------------------------------------------------------


def run(variant: str, seed: int, regret: float, first: int | None, trials: int = 13) -> Run:
    return Run(
        variant=variant,
        seed=seed,
        budget=10,
        regret=regret,
        hv_gap=0.1 * seed,
        cost_s=10.0 + seed,
        trials=trials,
        stopped_early=0,
        first_within_5pct=first,
        claim_error=-0.01 * seed,
    )


RUNS = [
    # random: two seeds never got within 5%.
    run("random", 0, 0.10, 3),
    run("random", 1, 0.00, None),
    run("random", 2, 0.20, 7),
    run("random", 3, 0.04, None),
    run("tpe", 0, 0.05, 2),
    run("tpe", 1, 0.00, 5),
    run("tpe", 2, 0.30, None, trials=14),
    run("tpe", 3, 0.00, 4),
]


def test_table_shares_medians_and_trials_to_5pct_with_runs_that_never_got_there() -> None:
    rows = {r["variant"]: r for r in table(RUNS, [10])}
    rnd, tpe = rows["random"], rows["tpe"]
    assert rnd["within5@10"] == 0.5  # 0.00 and 0.04
    assert tpe["within5@10"] == 0.75  # 0.05 counts, 0.30 does not
    assert rnd["regret@10"] == pytest.approx(0.07)  # median of 0, 0.04, 0.10, 0.20
    assert tpe["regret_mean@10"] == pytest.approx(0.0875)
    assert rnd["hv_gap@10"] == pytest.approx(0.15) and rnd["cost_s@10"] == 11.5
    assert rnd["claim_error@10"] == pytest.approx(0.015)  # of the absolute errors
    # tpe: 2, 4, 5 and never: the median is 4.5 (the seed that never got there counts).
    assert tpe["trials_to_5pct"] == 4.5 and tpe["trials_to_5pct_above"] is None
    assert tpe["reached_5pct"] == "3/4"
    # random: 3, 7, never, never: the median is not reached; it is above the median of
    # 3, 7, 13, 13 (a seed that never got there counted as the trials it ran).
    assert rnd["trials_to_5pct"] is None and rnd["trials_to_5pct_above"] == 10
    assert rnd["reached_5pct"] == "2/4"
    assert cli.trials_to_5pct_text(tpe) == "4.5"
    assert cli.trials_to_5pct_text(rnd) == ">10"
    assert trials_to_5pct([]) == (None, None)
    assert trials_to_5pct([run("x", 0, 0.1, None, 12), run("x", 1, 0.1, None, 14)]) == (None, 13)


def test_table_mean_regret_interval_and_paired_comparison_with_random() -> None:
    rows = {r["variant"]: r for r in table(RUNS, [10])}
    rnd, tpe = rows["random"], rows["tpe"]
    for r in (rnd, tpe):
        low, high = r["regret_ci@10"]
        assert low <= r["regret_mean@10"] <= high
        assert low >= 0.0 and high <= 0.30
    assert f"vs_{BASE_VARIANT}@10" not in rnd
    paired = tpe["vs_random@10"]
    # tpe - random, seed by seed: -0.05, 0, +0.10, -0.04.
    assert paired["mean"] == pytest.approx(0.0025)
    assert paired["wins"] == 2 and paired["losses"] == 1 and paired["pairs"] == 4
    low, high = paired["ci"]
    assert -0.05 <= low <= paired["mean"] <= high <= 0.10
    assert table(RUNS, [10])[1]["vs_random@10"] == paired  # a fixed bootstrap seed
    # The same regret at every seed: an interval of width zero.
    same = table([run("random", s, 0.1, 1) for s in range(5)], [10])[0]
    assert same["regret_ci@10"] == pytest.approx([0.1, 0.1])
    # Without a random variant there is nothing to pair with.
    alone = table([r for r in RUNS if r.variant == "tpe"], [10])[0]
    assert "vs_random@10" not in alone


def test_replay_section_renders_halves_non_reached_and_the_paired_table() -> None:
    text = cli.replay_section(table(RUNS, [10]), [10], 4)
    assert "trials to <=5% @10 (all trials run)" in text
    tpe_line = next(line for line in text.splitlines() if line.startswith("| tpe | 0."))
    assert "| 4.5 | 3/4 |" in tpe_line
    assert "| >10 | 2/4 |" in text
    assert "paired vs random @10: mean diff [CI], wins/losses" in text
    assert re.search(
        r"^\| tpe \| 8\.\d% \[\d+\.\d%, \d+\.\d%\] \| \+0\.\d pp \[-\d\.\d, \+\d\.\d\], 2/1 \|$",
        text,
        re.MULTILINE,
    )
    assert re.search(r"^\| random \| 8\.5% \[.*\] \| - \|$", text, re.MULTILINE)


# --- replay_one on a tiny table -----------------------------------------------------------


def tiny_truth() -> Truth:
    """QUICK_SPACE's 4 configurations, 3 repeats each; val_loss is set by the batch size.
    Binary fractions for the costs so that sums are exact."""
    losses = {32: (1.000, 1.001, 0.999), 64: (1.500, 1.502, 1.498)}
    speeds = {
        B32_W0: (100.0, 110.0, 90.0),
        B32_W1: (200.0, 230.0, 170.0),
        B64_W0: (120.0, 125.0, 115.0),
        B64_W1: (260.0, 300.0, 220.0),
    }
    return Truth.of(
        [
            entry(
                params,
                sorted(speed)[1],
                losses[params.batch_size][0],
                throughputs=speed,
                val_losses=losses[params.batch_size],
                wall_s=1.0 + params.num_workers,
                short_wall_s=0.25 + params.num_workers,
                ceiling_wall_s=0.125 if params.batch_size == 32 else 0.0625,
            )
            for params, speed in speeds.items()
        ]
    )


VARIANT = Variant("tpe (default)", SamplerConfig())


def test_replay_one_is_deterministic_for_a_seed() -> None:
    truth = tiny_truth()
    first = replay_one(truth, QUICK_SPACE, VARIANT, 3, 6, TRAINING)
    again = replay_one(truth, QUICK_SPACE, VARIANT, 3, 6, TRAINING)
    assert first == again
    assert first.trials >= 6 and first.cost_s > 0
    assert 0.0 <= first.regret <= 1.0 and 0.0 <= first.hv_gap <= 1.0
    assert dataclasses.asdict(first)["variant"] == "tpe (default)"  # what cli saves


@pytest.mark.parametrize("seed", range(4))
def test_replay_charges_one_ceiling_reading_per_batch_size_and_threads(seed: int) -> None:
    truth = tiny_truth()
    replay = _Replay(truth, QUICK_SPACE, VARIANT, seed, TRAINING)
    trials = replay.run(6)
    seen: set[tuple[int, int]] = set()
    expected = 0.0
    for trial in trials:
        # Stored in the space's terms, as the service stores them; the table's looked up.
        params = _to_table(LoaderParams.from_dict(trial.user_attrs[PARAMS_ATTR]), QUICK_SPACE)
        stored = truth.entries[params]
        expected += stored.short_wall_s if VAL_LOSS_FROM in trial.user_attrs else stored.wall_s
        pair = (params.batch_size, params.torch_threads)
        # The first trial of the pair reads the ceiling; the later ones reuse it.
        assert (CEILING_ATTR in trial.user_attrs) == (pair not in seen)
        if pair not in seen:
            expected += truth.ceiling_wall_s[pair]
            seen.add(pair)
    assert replay.cost == expected


@pytest.mark.parametrize("seed", range(6))
def test_replay_confirms_in_paired_rounds_as_the_worker_does(seed: int) -> None:
    replay = _Replay(tiny_truth(), QUICK_SPACE, VARIANT, seed, TRAINING)
    trials = replay.run(5)
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert not any(t.user_attrs.get(CONFIRMATION_ATTR) for t in trials[:5])
    rounds = Counter(
        t.user_attrs[CONFIRM_ROUND_ATTR] for t in trials if t.user_attrs.get(CONFIRMATION_ATTR)
    )
    summary = summarize_trials("replay", trials, 0.05)
    assert summary.recommended is not None
    if not rounds:  # no setting beat the baseline's reading: nothing to confirm
        assert summary.recommended.paired is None
        return
    settings = replay.confirm
    # Whole rounds, numbered from 0, at least the minimum and at most the cap, each with the
    # baseline and the candidates (the tiny table has at most 2 within the loss tolerance).
    assert sorted(rounds) == list(range(len(rounds)))
    assert settings.min_rounds <= len(rounds) <= settings.max_rounds
    assert all(2 <= n <= 3 for n in rounds.values())
    paired = summary.recommended.paired
    assert paired is not None and paired.rounds == len(rounds)
    assert summary.recommended.speedup_vs_baseline == paired.estimate
    # Nothing more is asked once the rounds ended.
    assert len(replay.run(0)) == len(trials)


def _search(params: LoaderParams) -> dict[str, Any]:
    """The search-space values that give ``params`` in QUICK_SPACE (prefetch is step 1)."""
    if params.num_workers == 0:
        return {"num_workers": 0}
    return {"num_workers": params.num_workers, "prefetch_factor": 1}


def test_quick_space_has_the_four_configurations_the_tests_assume() -> None:
    assert [(p.batch_size, p.num_workers) for p in QUICK_SPACE.configs()] == [
        (32, 0),
        (32, 1),
        (64, 0),
        (64, 1),
    ]
    assert math.isclose(tiny_truth().best_throughput, 260.0)


def test_the_standin_table_holds_the_default_rules_threads_only() -> None:
    configs = STANDIN_SPACE.configs()
    assert len(configs) == len(FULL_SPACE.configs()) // 2 == 76
    assert all(p.torch_threads == default_torch_threads(p.num_workers, 2) for p in configs)
    # Its config is the stand-in: a training step that waits on a "device" per sample.
    config = load_config(REGIMES["standin"].config)
    assert config.workload_options["device_us_per_sample"] > 0
