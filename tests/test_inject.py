"""The command workload's start-up hook, in real processes: a user's script run unchanged with
the hook's PYTHONPATH and a trial folder, and the state file it leaves there."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path
from typing import Any

import loader_search
from loader_search.trial._report import report_val_loss

HOOK_DIR = Path(loader_search.__file__).parent / "trial" / "_hook"
PACKAGE_PARENT = Path(loader_search.__file__).parent.parent
ALL = ["batch_size", "num_workers", "prefetch_factor", "pin_memory", "persistent_workers"]

# 512 samples, batches of 32: 16 a epoch as the user wrote it. The script prints what its
# loop saw; the hook's view is in the state file.
_COMMON = """
import os, sys
import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, IterableDataset,
                              RandomSampler, TensorDataset)
from loader_search.trial._report import report_val_loss

torch.manual_seed(0)
x = torch.randn(512, 8)
y = x.sum(1, keepdim=True)
train = TensorDataset(x, y)
val = TensorDataset(x[:128], y[:128])
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


class WithPid(Dataset):
    # Each sample says which process loaded it: worker processes are seen, not assumed.
    def __len__(self):
        return len(train)

    def __getitem__(self, i):
        return train[i][0], train[i][1], torch.tensor(os.getpid())


def epochs(loader, val_loader, count=4):
    pids = set()
    for epoch in range(count):
        batches = 0
        for batch in loader:
            xb, yb = batch[0], batch[1]
            if len(batch) > 2:
                pids.update(batch[2].tolist())
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            batches += 1
        with torch.no_grad():
            val_loss = sum(
                torch.nn.functional.mse_loss(model(a), b).item() for a, b in val_loader
            )
        report_val_loss(val_loss)
        print("epoch", epoch, batches)
    print("pids", sorted(pids - {os.getpid()}))
"""


def _trial_folder(tmp_path: Path) -> Path:
    """A trial's private folder with the default settings in it."""
    trial = tmp_path / "trial"
    trial.mkdir()
    (trial / "settings.json").write_text(json.dumps(_settings()))
    return trial


def _probe(
    code: str,
    *args: str,
    env: dict[str, str],
    python: str = sys.executable,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -c code args`` run to its end in ``env`` (the hook's, see `_env`)."""
    return subprocess.run(
        [python, "-c", code, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )


def _settings(**changes: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "batch_size": 64,
        "num_workers": 0,
        "prefetch_factor": None,
        "pin_memory": False,
        "persistent_workers": False,
        "inject": ALL,
        "train_samples": 1200,
        "warmup_batches": 3,
        "train_loader": None,
        "progress_interval_s": 0.5,
    }
    settings.update(changes)
    return settings


def _env(trial: Path | None, user_path: str | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOADER_SEARCH_TRIAL")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    parts = [str(HOOK_DIR), str(PACKAGE_PARENT)]
    if user_path:
        parts.append(user_path)
    env["PYTHONPATH"] = os.pathsep.join(parts)
    if trial is not None:
        env["LOADER_SEARCH_TRIAL_DIR"] = str(trial)
    env.update(extra)
    return env


def _run(
    tmp_path: Path,
    body: str,
    settings: dict[str, Any] | None,
    *,
    user_path: str | None = None,
    **extra: str,
) -> tuple[Path, Path, str]:
    """Run a script (``_COMMON`` then ``body``) in a trial; (script, trial folder, stdout)."""
    script = tmp_path / "train.py"
    script.write_text(_COMMON + textwrap.dedent(body))
    trial = tmp_path / "trial"
    trial.mkdir()
    if settings is not None:
        (trial / "settings.json").write_text(json.dumps(settings))
    done = subprocess.run(
        [sys.executable, str(script)],
        env=_env(trial if settings is not None else None, user_path, **extra),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return script, trial, done.stdout


def _line_of(script: Path, text: str) -> str:
    lines = script.read_text().splitlines()
    return f"{script}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def _state(trial: Path) -> dict[str, Any]:
    assert not list(trial.glob("hook-error-*")), [p.read_text() for p in trial.glob("hook-*")]
    (path,) = trial.glob("proc-*.json")
    state: dict[str, Any] = json.loads(path.read_text())
    assert path.name == f"proc-{state['pid']}.json"
    return state


def _epochs(stdout: str) -> list[int]:
    return [int(line.split()[2]) for line in stdout.splitlines() if line.startswith("epoch")]


def test_the_shuffling_loader_gets_the_trial_settings_and_stops_at_the_budget(
    tmp_path: Path,
) -> None:
    settings = _settings(num_workers=2, prefetch_factor=2, persistent_workers=True)
    script, trial, out = _run(
        tmp_path,
        """
        val_loader = DataLoader(val, batch_size=64)
        loader = DataLoader(WithPid(), batch_size=32, shuffle=True)
        print("num_workers", loader.num_workers, loader.batch_size, loader.persistent_workers)
        epochs(loader, val_loader)
        """,
        settings,
    )
    assert "num_workers 2 64 True" in out
    pids = json.loads(out.split("pids ", 1)[1].splitlines()[0])
    assert len(pids) == 2  # two loader worker processes really loaded the samples
    # A batch is never cut: the iteration ends at the first batch that reaches the budget
    # (512 + 512 + 3 * 64 = 1216 >= 1200), and every later epoch is empty.
    assert _epochs(out) == [8, 8, 3, 0]
    state = _state(trial)
    assert state["samples"] == 1216 and state["batches"] == 19
    assert state["budget_reached"] is True
    assert state["budget_reached_at"] > state["val_losses"][1][0]
    assert (state["rank"], state["world_size"], state["local_rank"]) == (0, 1, 0)
    first, second = state["loaders"]
    assert first["index"] == 1 and not first["train"] and not first["shuffle"]
    assert first["applied"] == {} and first["num_workers"] == 0
    assert second["index"] == 2 and second["train"] and second["shuffle"]
    assert second["site"] == _line_of(script, "loader = DataLoader(WithPid()")
    assert second["applied"] == {name: settings[name] for name in ALL}
    assert second["not_applied"] == {} and second["num_workers"] == 2
    assert second["iterable"] is False
    assert state["ticks"] == 4 * 2  # two validation batches in each of the four epochs
    window = state["window"]
    assert window["warmup_batches"] >= 3 + 2 * 2  # the trial's warm-up and the prefetched
    assert 0 < window["measured_samples"] <= 1216 and window["throughput"] > 0
    assert window["time_to_first_batch_s"] > 0 and window["measured_time_s"] > 0
    assert [len(pair) for pair in state["val_losses"]] == [2, 2, 2, 2]
    assert state["peak_rss_bytes"] > 0 and state["cpu_s"] > 0


def test_a_batch_sampler_keeps_its_batch_size_and_a_rank_gets_its_share(
    tmp_path: Path,
) -> None:
    _, trial, out = _run(
        tmp_path,
        """
        sampler = BatchSampler(RandomSampler(train), batch_size=32, drop_last=False)
        loader = DataLoader(train, batch_sampler=sampler)
        epochs(loader, DataLoader(val, batch_size=64), count=2)
        """,
        _settings(),
        WORLD_SIZE="2",
        RANK="1",
        LOCAL_RANK="1",
    )
    state = _state(trial)
    (loader, _) = state["loaders"]
    assert loader["train"] and loader["shuffle"]  # shuffling through its batch sampler
    assert loader["not_applied"] == {"batch_size": "a batch_sampler fixes the batch size"}
    assert loader["applied"] == {name: _settings()[name] for name in ALL[1:]}
    share = math.ceil(1200 / 2)
    assert state["samples"] == 608 >= share  # 19 batches of 32: the first at or past 600
    assert _epochs(out) == [16, 3]
    assert (state["rank"], state["world_size"], state["local_rank"]) == (1, 2, 1)


def test_train_loader_n_chooses_the_n_th_loader_built(tmp_path: Path) -> None:
    script, trial, out = _run(
        tmp_path,
        """
        class Stream(IterableDataset):
            def __iter__(self):
                return iter(val)

        pretrain = DataLoader(train, batch_size=16, shuffle=True)
        loader = DataLoader(train, batch_size=32)
        stream = DataLoader(Stream(), batch_size=64)
        epochs(loader, stream, count=3)
        """,
        _settings(train_loader=2, inject=["batch_size"], train_samples=1024),
    )
    state = _state(trial)
    pretrain, chosen, stream = state["loaders"]
    assert pretrain["shuffle"] and not pretrain["train"] and pretrain["batch_size"] == 16
    assert chosen["train"] and chosen["site"] == _line_of(script, "loader = DataLoader(train")
    assert chosen["applied"] == {"batch_size": 64} and chosen["batch_size"] == 64
    assert stream["iterable"] is True and not stream["train"]
    # 1024 samples is two epochs exactly: reached at the second epoch's end, the third empty.
    assert _epochs(out) == [8, 8, 0] and state["samples"] == 1024
    assert state["budget_reached"] is True and len(state["val_losses"]) == 3


def test_without_a_shuffling_loader_the_first_built_is_initialised_again(
    tmp_path: Path,
) -> None:
    _, trial, out = _run(
        tmp_path,
        """
        loader = DataLoader(WithPid(), batch_size=32)
        val_loader = DataLoader(val, batch_size=64)
        print("before", loader.num_workers)
        epochs(loader, val_loader, count=3)
        print("after", loader.num_workers, loader.batch_size, loader.prefetch_factor)
        """,
        _settings(num_workers=1, prefetch_factor=3, inject=["num_workers", "prefetch_factor"]),
    )
    assert "before 0" in out and "after 1 32 3" in out
    # One worker for each of the three epochs (not persistent: the user's own choice).
    assert len(json.loads(out.split("pids ", 1)[1].splitlines()[0])) == 3
    assert _epochs(out) == [16, 16, 6]  # 1216 >= 1200 after 38 batches of 32
    state = _state(trial)
    first, second = state["loaders"]
    assert first["train"] and not first["shuffle"] and first["num_workers"] == 1
    assert first["applied"] == {"num_workers": 1, "prefetch_factor": 3}
    assert not second["train"] and state["samples"] == 1216


def test_the_users_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
    trial = _trial_folder(tmp_path)
    probe = (
        "import os, sys, sitecustomize; print(os.environ.get('USER_SITE_RAN'),"
        " 'loader_search.trial._inject' in sys.modules, 'torch' in sys.modules,"
        " os.path.dirname(sitecustomize.__file__))"
    )
    printed = _probe(probe, env=_env(trial, str(theirs))).stdout
    # Both ran; ours is still the one imported, and torch was not loaded for it.
    assert printed.split() == ["1", "True", "False", str(HOOK_DIR)]
    assert list(trial.iterdir()) == [trial / "settings.json"]  # nothing built: no state file


def test_outside_a_trial_the_hook_does_nothing(tmp_path: Path) -> None:
    _, trial, out = _run(
        tmp_path,
        """
        loader = DataLoader(train, batch_size=32, shuffle=True)
        epochs(loader, DataLoader(val, batch_size=64), count=2)
        print("patched", hasattr(DataLoader, "_loader_search_patched"))
        """,
        None,
    )
    assert _epochs(out) == [16, 16] and "patched False" in out
    assert list(trial.iterdir()) == []


def test_a_command_without_loader_search_runs_on_and_says_why(tmp_path: Path) -> None:
    # The command's own environment: a bare virtual environment of the same Python.
    venv.EnvBuilder(with_pip=False).create(tmp_path / "env")
    python = tmp_path / "env" / "bin" / "python"
    trial = _trial_folder(tmp_path)
    env = _env(trial)
    env["PYTHONPATH"] = str(HOOK_DIR)  # the hook alone: loader_search is not on the path
    done = _probe("print('ran')", env=env, python=str(python), cwd=tmp_path)
    assert done.stdout == "ran\n" and done.stderr == ""
    # Said as data, for the parent's one line (loader_search.trial._command_read): this
    # Python, and what it lacks (torch first, as the script will need it).
    (error,) = trial.glob("import-error-*.json")
    assert json.loads(error.read_text()) == {
        "python": str(python),
        "missing": ["torch", "psutil"],
    }
    assert not list(trial.glob("hook-error-*"))


def test_report_val_loss_outside_a_trial_is_a_cheap_no_op(tmp_path: Path) -> None:
    env = _env(None)
    probe = (
        "import sys\nfrom loader_search.trial._report import report_val_loss\n"
        "report_val_loss(0.5)\nprint('torch' in sys.modules)\n"
    )
    done = _probe(probe, env=env, cwd=tmp_path)
    assert done.stdout == "False\n" and list(tmp_path.iterdir()) == []
    assert "LOADER_SEARCH_TRIAL_DIR" not in os.environ
    report_val_loss(1.0)  # in this process too: nothing happens, nothing raises


def test_report_val_loss_in_a_trial_writes_at_once_and_never_raises(tmp_path: Path) -> None:
    trial = _trial_folder(tmp_path)
    probe = (
        "import json, os, sys\nfrom loader_search.trial._report import report_val_loss\n"
        "report_val_loss(0.5)\n"
        "state = json.load(open(os.path.join(sys.argv[1], f'proc-{os.getpid()}.json')))\n"
        "print(state['val_losses'][0][1], 'torch' in sys.modules)\n"
        "report_val_loss('not a number')\nprint('went on')\n"
    )
    assert _probe(probe, str(trial), env=_env(trial)).stdout == "0.5 False\nwent on\n"
    (error,) = trial.glob("hook-error-*.txt")
    assert "could not convert string to float" in error.read_text()


def test_between_epochs_the_window_stops_with_the_last_batch(tmp_path: Path) -> None:
    _, trial, out = _run(
        tmp_path,
        """
        import time
        loader = DataLoader(train, batch_size=32, shuffle=True)
        for epoch in range(2):
            batches = 0
            for xb, yb in loader:
                time.sleep(0.002)
                batches += 1
            time.sleep(0.5)  # a long validation: not training time
            print("epoch", epoch, batches)
        time.sleep(0.5)  # saving the model after the loop
        """,
        _settings(train_samples=10**6, inject=[]),
    )
    assert _epochs(out) == [16, 16]
    state = _state(trial)
    assert state["budget_reached"] is False and state["budget_reached_at"] is None
    assert state["samples"] == 1024 and state["batches"] == 32
    window = state["window"]
    assert window["measured_samples"] == (32 - window["warmup_batches"]) * 32
    assert window["measured_time_s"] < 0.5  # neither the validations nor the saving
