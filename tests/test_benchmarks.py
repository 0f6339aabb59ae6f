"""The benchmark suite's quick mode: every part runs end to end on real (tiny) trials and
writes its tables. It checks that the suite works, not what it measures (this machine is
shared and noisy; benchmarks/RESULTS.md holds the measured figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_quick_benchmark_runs_every_part(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "all", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "all.json").read_text())
    report = (tmp_path / "all.md").read_text()
    for heading in ("## Ground truth", "## Noise", "## Search quality", "## Speedup and cost"):
        assert heading in report

    # Ground truth: every configuration of the quick grid, measured twice by real trials.
    truth = results["ground_truth"]
    assert truth["configs"] == 4 and truth["repeats"] == 2
    rows = [json.loads(line) for line in (tmp_path / "ground_truth_quick.jsonl").open()]
    assert len(rows) == 8 and all(r["throughput"] > 0 and r["val_loss"] > 0 for r in rows)
    table = json.loads((tmp_path / "ground_truth_table.json").read_text())["configs"]
    assert all(len(c["throughputs"]) == 2 and c["ceiling"] > 0 for c in table)

    # Replay: every variant at every budget, with values that are fractions.
    replay = results["replay"]
    assert {r["variant"] for r in replay} >= {"tpe (default)", "random", "random, 2x trials"}
    for row in replay:
        for budget in (6, 10):
            assert 0.0 <= row[f"regret@{budget}"] <= 1.0
            assert 0.0 <= row[f"hv_gap@{budget}"] <= 1.0
            assert row[f"cost_s@{budget}"] > 0
    early = next(r for r in replay if r["variant"] == "tpe (default)")
    full = next(r for r in replay if r["variant"] == "tpe, no early stop")
    assert early["cost_s@10"] < full["cost_s@10"]  # shortened trials are cheaper

    # Speedup: a real study, then three loaders side by side with their ceilings.
    speedup = results["speedup"]
    assert set(speedup["contenders"]) == {"baseline", "rule of thumb", "recommended"}
    for contender in speedup["contenders"].values():
        assert contender["throughput"] > 0 and contender["ceiling"] > 0
        assert len(contender["throughputs"]) == 2
    cost = speedup["cost"]
    assert cost["trials"] >= 6 and cost["train_s"] > 0
    assert cost["study_wall_s"] >= cost["train_s"] + cost["eval_s"]
