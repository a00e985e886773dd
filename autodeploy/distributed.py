"""The process group of a deployment over several ranks, one process each, as ``torchrun`` launches them.

``autodeploy(model, distributed={"tensor_parallel": N})`` in each of ``torchrun --nproc-per-node N``'s
processes: :func:`init_distributed` joins them (``torch.distributed`` from torchrun's RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; LOCAL_RANK picks the GPU) before the graph is built, so the ``shard`` stage
knows its rank and every collective has its group. Every rank then builds, verifies and serves the same
deployment over its own slices; the processes call ``generate`` alike (the same script), and the logits
after the last all-reduce are the same bits on every rank, so every rank samples the same tokens.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from autodeploy.errors import ConfigError

_TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(settings) -> None:
    """Join (or check) the process group that ``settings.distributed`` asks for; on a GPU, point
    ``settings.device`` at this rank's (LOCAL_RANK). A ``ConfigError`` when the processes do not match."""
    parallel = int(settings.distributed.tensor_parallel)
    if parallel == 1:
        return
    if not dist.is_initialized():
        missing = [name for name in _TORCHRUN if name not in os.environ]
        if missing:
            raise ConfigError(
                f"distributed.tensor_parallel={parallel} runs one process per rank: launch with "
                f"`torchrun --nproc-per-node {parallel} your_script.py` (missing {', '.join(missing)}), or call "
                f"torch.distributed.init_process_group first")
        world = int(os.environ["WORLD_SIZE"])
        if world != parallel:
            raise ConfigError(f"distributed.tensor_parallel={parallel} but torchrun started {world} processes "
                              f"(WORLD_SIZE); start {parallel}, or set tensor_parallel={world}")
        cuda = str(settings.device).startswith("cuda")
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
            if local >= torch.cuda.device_count():
                raise ConfigError(f"rank {os.environ['RANK']} needs GPU {local}, but {torch.cuda.device_count()} "
                                  f"are visible; start at most that many processes a machine")
            settings.device = f"cuda:{local}"
            torch.cuda.set_device(local)
        backend = settings.distributed.backend
        if backend == "auto":
            backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=float(settings.distributed.timeout_s)))
        atexit.register(_leave)
    if dist.get_world_size() != parallel:
        raise ConfigError(f"distributed.tensor_parallel={parallel} but the process group has "
                          f"{dist.get_world_size()} ranks; they must match")


def _leave() -> None:
    # The group this module joined, left at interpreter exit (PyTorch warns about a group left open).
    if dist.is_initialized():
        dist.destroy_process_group()
