"""A least-squares problem held at fixed parameters, whose gradient noise scale is known
exactly: for the noise scale's tests (tests/test_noise.py) and a goodput study through the CLI
(tests/test_goodput.py, as a plug-in)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from loader_search import Workload

N, D = 4096, 16  # samples, features


def least_squares(offset: float = 0.05) -> tuple[Workload, float]:
    """y = X w* + noise on a fixed data set, a linear model held at w0 = w* + ``offset`` x a
    random direction (the optimizer's learning rate is 0, so the gradient's mean and
    covariance never move), and the noise scale the estimator should find there, computed
    exactly from the per-sample gradients (a larger ``offset``: a larger mean gradient, a
    smaller noise scale).

    The loss is the mean of (x.w - y)^2, so a sample's gradient is 2 (x.w0 - y) x: G is their
    mean and Sigma their covariance over the N samples. The loader draws each batch without
    replacement from the N samples, so a batch mean's covariance is Sigma/b (N-b)/(N-1) (Sigma
    with 1/N); in expectation the per-step estimates are then tr(Sigma_{N-1}) and
    |G|^2 - tr(Sigma_N)/(N-1), and their ratio is the target (2% above tr(Sigma)/|G|^2 here).
    """
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=generator, dtype=torch.float64)
    w_star = torch.randn(D, generator=generator, dtype=torch.float64)
    y = x @ w_star + 0.5 * torch.randn(N, generator=generator, dtype=torch.float64)
    w0 = w_star + offset * torch.randn(D, generator=generator, dtype=torch.float64)
    per_sample = 2 * (x @ w0 - y)[:, None] * x
    mean = per_sample.mean(0)
    trace = float(torch.cov(per_sample.T).trace())  # 1/(N-1)
    target = trace / (float(mean.square().sum()) - trace / N)

    def make_model() -> nn.Module:
        model = nn.Linear(D, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(w0.float()[None])
        return model

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs.squeeze(-1), targets)

    workload = Workload(
        name="least-squares",
        train_dataset=TensorDataset(x.float(), y.float()),
        val_dataset=TensorDataset(x[:256].float(), y[:256].float()),
        make_model=make_model,
        loss_fn=loss_fn,
        make_optimizer=lambda parameters, lr: torch.optim.SGD(parameters, lr=0.0),
    )
    return workload, target


def build(offset: float = 0.05) -> Workload:
    """The plug-in: the workload alone."""
    return least_squares(offset)[0]
