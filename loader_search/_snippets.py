"""Ready-to-paste Python for recommended settings: the DataLoader (or the thread-pool loader),
the training step the study measured, the launch of a multi-rank recommendation, and the
accumulation loop of a batch trained as micro-batches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loader_search.params import LoaderParams


def dataloader_snippet(
    params: LoaderParams,
    dataset_name: str = "train_dataset",
    lr: float | None = None,
    step: Mapping[str, Any] | None = None,
) -> str:
    """Ready-to-paste Python for the recommended settings.

    ``lr`` is the learning rate the trial trained with: a different batch size than the
    user's comes with its scaled learning rate, and the snippet says so. ``step``: the
    training step's settings that differ from the defaults (``precision``,
    ``matmul_precision``, ``compile``, ``channels_last``), as the study's fingerprint holds
    them: the lines of the step the measurement used come first.
    """
    lines = step_snippet(step or {})
    ranks = int((step or {}).get("ranks", 1)) if (step or {}).get("ranks") != "auto" else 1
    if ranks > 1:
        lines += ranks_snippet(params, ranks, dataset_name)
    if lr is not None:
        lines.append(f"# train with lr={lr:.4g} at this batch size (as measured)")
    lines.append(f"torch.set_num_threads({params.torch_threads})")
    if params.backend == "thread":
        lines.append(thread_loader_snippet(params, dataset_name))
    else:
        order = "sampler=sampler" if ranks > 1 else "shuffle=True"
        args = [dataset_name, f"batch_size={params.micro_batch_size}", order]
        args.append(f"num_workers={params.num_workers}")
        if params.num_workers > 0:
            args.append(f"prefetch_factor={params.prefetch_factor}")
            args.append(f"persistent_workers={params.persistent_workers}")
            if not params.in_order:
                args.append("in_order=False")
            if params.start_method is not None:
                args.append(f'multiprocessing_context="{params.start_method}"')
        args.append(f"pin_memory={params.pin_memory}")
        lines.append("loader = DataLoader(\n    " + ",\n    ".join(args) + ",\n)")
    if params.accumulation_steps > 1:
        lines.append(accumulation_snippet(params))
    return "\n".join(lines)


def step_snippet(step: Mapping[str, Any]) -> list[str]:
    """The lines of the training step a study measured (see `dataloader_snippet`)."""
    lines = []
    if step.get("matmul_precision"):
        lines.append(f'torch.set_float32_matmul_precision("{step["matmul_precision"]}")')
    if step.get("channels_last"):
        lines.append("model = model.to(memory_format=torch.channels_last)  # and 4-D inputs")
    compile_ = step.get("compile")
    if compile_ is True or compile_ == "default":
        lines.append("model = torch.compile(model)")
    elif isinstance(compile_, str) and compile_:
        lines.append(f'model = torch.compile(model, mode="{compile_}")')
    precision = step.get("precision", "fp32")
    if precision in ("bf16", "fp16"):
        dtype = "bfloat16" if precision == "bf16" else "float16"
        if precision == "fp16":
            lines.append('scaler = torch.amp.GradScaler("cuda")  # scaler.scale(loss).backward()')
        lines.append(
            f"# the forward and the loss under autocast: with torch.autocast(device.type,"
            f" dtype=torch.{dtype}):"
        )
    if lines:
        lines.insert(0, "# the training step as measured")
    return lines


def node_totals(params: LoaderParams, ranks: int) -> dict[str, int]:
    """What ``ranks`` ranks of ``params`` ask of one node, all ranks together."""
    return {
        "ranks": ranks,
        "loader_processes": ranks * params.num_workers if params.backend == "process" else 0,
        "main_processes": ranks,
        "torch_threads": ranks * params.torch_threads,
        "pin_memory_threads": ranks if params.pin_memory else 0,
        "batches_in_flight": ranks * params.batches_in_flight,
    }


def ranks_snippet(params: LoaderParams, ranks: int, dataset_name: str) -> list[str]:
    """The launch and the sampler of a multi-rank recommendation (each rank runs the rest)."""
    node = node_totals(params, ranks)
    return [
        f"# launch: torchrun --nproc_per_node={ranks} train.py (every rank runs what follows;"
        " DistributedDataParallel(model))",
        f"# the node: {node['main_processes']} training processes,"
        f" {node['loader_processes']} loader processes, {node['torch_threads']} torch threads,"
        f" {node['batches_in_flight']} batches in flight in /dev/shm",
        "from torch.utils.data.distributed import DistributedSampler",
        f"sampler = DistributedSampler({dataset_name}, shuffle=True)"
        "  # sampler.set_epoch(epoch) before each epoch",
    ]


def thread_loader_snippet(params: LoaderParams, dataset_name: str = "train_dataset") -> str:
    """The thread-pool loader (``torchdata.nodes``) that ``backend = "thread"`` measured."""
    lines = [
        "# pip install torchdata: a pool of threads in this process loads the samples",
        "from torch.utils.data import RandomSampler, default_collate",
        "from torchdata.nodes import Batcher, Loader, Mapper, ParallelMapper, Prefetcher,"
        " SamplerWrapper",
        f"node = SamplerWrapper(RandomSampler({dataset_name}))",
        f"node = ParallelMapper(node, {dataset_name}.__getitem__,"
        f' num_workers={params.num_workers}, method="thread", in_order={params.in_order})',
        f"node = Batcher(node, batch_size={params.micro_batch_size}, drop_last=False)",
        "node = Mapper(node, default_collate)",
        f"node = Prefetcher(node, prefetch_factor={params.prefetch_factor})",
    ]
    if params.pin_memory:
        lines.insert(2, "from torchdata.nodes import PinMemory")
        lines.append("node = PinMemory(node)")
    lines.append("loader = Loader(node)")
    return "\n".join(lines)


def accumulation_snippet(params: LoaderParams) -> str:
    """The training loop of an effective batch trained as accumulated micro-batches: where the
    loss is scaled and where ``optimizer.step()`` goes."""
    steps, micro = params.accumulation_steps, params.micro_batch_size
    return "\n".join(
        [
            f"# batch {params.batch_size} = {steps} micro-batches of {micro}, gradients"
            " accumulated (BatchNorm",
            f"# statistics are per micro-batch of {micro}, not per batch of {params.batch_size})",
            f"accumulation_steps = {steps}",
            "optimizer.zero_grad()",
            "for i, (inputs, targets) in enumerate(loader):",
            "    loss = loss_fn(model(inputs), targets) / accumulation_steps",
            "    loss.backward()",
            "    if (i + 1) % accumulation_steps == 0:",
            "        optimizer.step()",
            "        optimizer.zero_grad()",
        ]
    )
