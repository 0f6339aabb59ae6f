"""What one training run measured: `TrialResult`, the plain value every way of running a trial
returns (in this process, a forked child, a fresh interpreter, or several ranks merged)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TrialResult:
    """Everything one training run measured. Keys of `user_attrs` carry their unit."""

    throughput_samples_per_s: float
    val_loss: float | None  # None: stopped early, not evaluated (see `RunPlan`)
    val_accuracy: float | None
    data_wait_fraction: float
    time_to_first_batch_s: float
    peak_host_rss_bytes: int
    peak_gpu_bytes: int | None
    train_samples: int
    measured_samples: int
    measured_time_s: float
    warmup_batches: int
    epochs: int
    lr: float
    final_train_loss: float | None  # None: not seen (a command's own loop)
    train_time_s: float
    eval_time_s: float
    device: str
    stopped_early: bool = False
    # With `RunPlan.short_samples`: where the throughput window ended, the training time until
    # then (what a shortened trial costs), and the reading over the whole run (None when the
    # trial stopped there).
    short_samples: int | None = None
    short_train_time_s: float | None = None
    full_window_throughput_samples_per_s: float | None = None
    ceiling_samples_per_s: float | None = None
    # The loss of the first training batch, before any step: what the untrained model scores
    # (a validation loss above it is not credible; see loader_search.study._points).
    untrained_loss: float | None = None
    # The share of the machine's CPUs other processes used while the ceiling was read: a
    # reading taken while the machine was busy is not reused (see loader_search.study.work._plan).
    ceiling_other_load: float | None = None
    # Stage costs over the same window (see `loader_search.trial._stages`).
    producer_cpu_s_per_sample: float | None = None
    collate_cpu_s_per_batch: float | None = None
    main_cpu_s_per_batch: float | None = None
    cpu_used_cores: float | None = None
    cpus_available: int | None = None
    # The share of its CPUs other processes kept busy over the same window: a confirmation
    # reading taken beside a busy neighbour is measured again
    # (see loader_search.study.stats._confirm).
    other_load: float | None = None
    # The user's step (loader_search.trial._step): with torch.compile, the first training
    # step's time (compilation included) and the recompilations during the window, left out
    # of it; with fp16, the optimizer steps the gradient scaler skipped.
    compile_time_s: float | None = None
    window_recompiles: int | None = None
    window_recompile_s: float | None = None
    skipped_steps: int | None = None
    # The window's slowest step over its median step: a spike left in it shows here.
    slowest_step_over_median: float | None = None
    # The training process's minor page faults over the window (`WindowStats.minor_faults`).
    window_minor_faults: int | None = None
    # A multi-rank trial (loader_search.trial._ranks): its ranks, and each rank's figures
    # (lists, rank 0 first); the fields above are the node's.
    ranks: int | None = None
    per_rank: dict[str, list[Any]] | None = None
    # A command's trial (loader_search.trial._command): where the script built the training
    # loader the trial's settings went into ("file:line").
    loader_site: str | None = None
    # The gradient noise scale of the run (McCandlish et al. 2018, the "simple" estimator;
    # loader_search.trial._noise): B_simple = tr(Sigma) / |G|^2 and its standard error, the
    # two batch sizes its squared gradient norms were read at, the steps it averaged over, and
    # its two parts (the means of the per-step estimates of |G|^2 and tr(Sigma): what pools
    # across trials; with ranks, the sizes are a rank's batch and the node's). None where not
    # measured (a command's own loop; without accumulation or ranks, a compiled model or a
    # batch of one); the scale alone None where the mean |G|^2 was not positive (noise swamped
    # the signal).
    gradient_noise_scale: float | None = None
    gradient_noise_scale_se: float | None = None
    noise_small_batch: int | None = None
    noise_big_batch: int | None = None
    noise_steps: int | None = None
    noise_grad_sq: float | None = None
    noise_trace: float | None = None

    def user_attrs(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}
