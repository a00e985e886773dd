"""A second deployment in a process that drives a spawned distributed one (``autodeploy(model,
tensor_parallel=2)``, kept): a one-process deployment serves beside it; a second distributed one is a
``ConfigError`` at once, before any process starts, naming the live one and ``shutdown()``; after
``shutdown()``, or once the live ``LLM`` is garbage-collected, the next distributed deployment works. Under
torchrun, deployments laid out alike serve side by side and one laid out otherwise is refused until the
live ones are shut down (it would change the layout their collectives read).

Each flow runs in a fresh interpreter with ``distributed.timeout_s`` 120 (600 by default) and a ``timeout=``,
so a collective that waits on the wrong world fails the test instead of hanging it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

# Prints the JSON of the flow's `result` on the last line; `directory` and `moe_directory` are its arguments.
PRELUDE = """
import gc, json, sys
import autodeploy.api as api
from autodeploy import SamplingParams, autodeploy
from autodeploy.errors import ConfigError

directory, moe_directory = sys.argv[1:3]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [3, 4]]
WORLD = {"timeout_s": 120}

def tokens(llm):
    return [list(output.outputs[0].token_ids) for output in llm.generate(PROMPTS, GREEDY)]
"""

# One interpreter for the three flows of a spawned deployment (each interpreter imports torch, and so does the
# worker each distributed deployment spawns): a one-process deployment beside the live distributed one; a second
# distributed one refused while it lives; the live one dropped without shutdown(); then one deployed again and
# shut down, and one laid out otherwise after that shutdown.
SPAWNED = """
import torch.distributed as dist

def no_spawn(*args, **kwargs):
    raise AssertionError("a second deployment's workers were spawned")

distributed = autodeploy(directory, device="cpu", tensor_parallel=2, distributed=WORLD)
single = autodeploy(directory, device="cpu")
beside = {"single": tokens(single), "distributed": tokens(distributed)}
first = beside["distributed"]
spawn, api.spawn_workers = api.spawn_workers, no_spawn
refusals = []
for model, parallelism in ((directory, {"pipeline_parallel": 2}), (moe_directory, {"expert_parallel": 2}),
                           (directory, {"tensor_parallel": 2})):
    try:
        autodeploy(model, device="cpu", distributed=WORLD, **parallelism)
    except ConfigError as error:
        refusals.append(str(error))
unchanged = tokens(distributed)  # the refusals touched nothing of the live deployment
api.spawn_workers = spawn
(worker,) = distributed.workers.processes
del distributed
gc.collect()
code = worker.poll()  # None while it runs: stopping is synchronous, so it has exited by now
left = not dist.is_initialized()
again = autodeploy(directory, device="cpu", tensor_parallel=2, distributed=WORLD)
again_tokens = tokens(again)
again.shutdown()
staged = autodeploy(directory, device="cpu", pipeline_parallel=2, distributed=WORLD)
result = {"beside": beside, "first": first, "unchanged": unchanged, "refusals": refusals, "worker_exit": code,
          "group_left": left, "again": again_tokens, "after_shutdown": tokens(staged)}
staged.shutdown()
"""


TORCHRUN_LAYOUTS = """
llm = autodeploy(directory, device="cpu", tensor_parallel=2, distributed=WORLD)
twin = autodeploy(directory, device="cpu", tensor_parallel=2, distributed=WORLD)  # laid out alike: side by side
refusal = None
try:
    autodeploy(directory, device="cpu", pipeline_parallel=2, distributed=WORLD)
except ConfigError as error:
    refusal = str(error)
first, twin_tokens = tokens(llm), tokens(twin)
llm.shutdown()
twin.shutdown()
staged = autodeploy(directory, device="cpu", pipeline_parallel=2, distributed=WORLD)
result = {"first": first, "twin": twin_tokens, "refusal": refusal, "after_shutdown": tokens(staged)}
"""


def _run_flow(flow: str, *directories) -> dict:
    # Generous for a loaded machine (two or three small builds); a hang on the wrong world would take the
    # flow's collectives 120 s each before failing, and then it exits non-zero.
    run = subprocess.run([sys.executable, "-c", PRELUDE + flow + "\nprint(json.dumps(result))", *map(str, directories)],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def directories(tiny_checkpoint) -> tuple[str, str]:
    return str(tiny_checkpoint("llama")), str(tiny_checkpoint("mixtral"))


# The three tests read one run of SPAWNED.
@pytest.fixture(scope="module")
def spawned(directories) -> dict:
    return _run_flow(SPAWNED, *directories)


def test_a_one_process_deployment_serves_beside_a_live_distributed_one(spawned):
    # both serve, and tensor parallelism is exact on the CPU
    assert spawned["beside"]["single"] == spawned["beside"]["distributed"]


def test_a_second_distributed_deployment_is_refused_at_once_and_works_after_shutdown(spawned, directories):
    assert len(spawned["refusals"]) == 3
    for refusal in spawned["refusals"]:
        assert f"{directories[0]} with tensor_parallel=2" in refusal  # names the live deployment
        assert "shutdown()" in refusal
    assert spawned["unchanged"] == spawned["first"]
    assert spawned["after_shutdown"] == spawned["first"]  # pipeline parallel, exact as well


def test_a_distributed_llm_dropped_without_shutdown_takes_its_workers_and_group_with_it(spawned):
    assert spawned["worker_exit"] is not None and spawned["group_left"]
    assert spawned["again"] == spawned["first"]


def test_torchrun_deployments_laid_out_alike_serve_side_by_side_and_another_layout_waits_for_shutdown(directories):
    # Two ranks as `torchrun --nproc-per-node 2` starts them, each running the same flow.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    program = PRELUDE + TORCHRUN_LAYOUTS + "\nprint(json.dumps(result))"
    ranks = [subprocess.Popen([sys.executable, "-c", program, *directories], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2",
                                              "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank in range(2)]
    try:
        outputs = [rank.communicate(timeout=900) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, (stdout, stderr) in zip(ranks, outputs):
        assert rank.returncode == 0, stderr[-4000:]
        result = json.loads(stdout.strip().splitlines()[-1])
        assert result["refusal"] and f"{directories[0]} with tensor_parallel=2" in result["refusal"]
        assert "shutdown()" in result["refusal"]
        assert result["twin"] == result["first"] and result["after_shutdown"] == result["first"]
