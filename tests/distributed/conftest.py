"""One spawn of two ranks (two gloo processes, as ``torchrun --nproc-per-node 2`` starts them) runs the tensor-parallel
deploys of tests/distributed/test_tensor_parallel.py and test_tensor_parallel_layouts.py one after another: the two
torch-importing interpreters start once a session (of a pytest-xdist worker), not once a module."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, jobs: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    results = {name: job(rank, world, *args) for name, (job, args) in jobs.items()}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def one_kv_head_checkpoint(tmp_path_factory) -> Path:
    from tests.distributed.test_tensor_parallel_layouts import write_one_kv_head_checkpoint

    directory = tmp_path_factory.mktemp("qwen3-one-kv-head")
    write_one_kv_head_checkpoint(directory)
    return directory


@pytest.fixture(scope="session")
def two_ranks(tiny_checkpoint, one_kv_head_checkpoint, tmp_path_factory) -> list[dict]:
    """Each rank's results, by job: "architectures" (test_tensor_parallel's), "layouts" (test_tensor_parallel_layouts')."""
    from tests.distributed.test_tensor_parallel import ARCHITECTURES, deploy_each
    from tests.distributed.test_tensor_parallel_layouts import RULES, deploy_each_spied

    jobs = {"architectures": (deploy_each, ([str(tiny_checkpoint(arch)) for arch in ARCHITECTURES],)),
            "layouts": (deploy_each_spied, ([(str(one_kv_head_checkpoint), {}),
                                             (str(tiny_checkpoint("qwen2")), {"rules": RULES})],))}
    return run_two_ranks(jobs, tmp_path_factory.mktemp("two-ranks"))


def run_two_ranks(jobs: dict, directory: Path) -> list[dict]:
    """Run ``jobs`` (name → ``(function, args)``, each called as ``function(rank, world, *args)``) one after another
    on two spawned gloo ranks; each rank's results by job (JSON, written under ``directory``)."""
    from tests.distributed.test_tensor_parallel import _free_port

    out = str(directory / "rank")
    mp.start_processes(_rank, args=(2, _free_port(), jobs, out), nprocs=2, start_method="spawn")
    ranks = []
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            ranks.append(json.load(f))
    return ranks
