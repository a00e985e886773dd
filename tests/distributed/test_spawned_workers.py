"""``autodeploy(model, tensor_parallel=2)`` in a plain process: the other rank is spawned as a worker process,
and the returned ``LLM`` behaves as one process's (generate, stream, logits, AsyncLLM); a killed worker is
a ``WorkerError`` at once, never a hang; shutting down leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest
import torch

from autodeploy import AsyncLLM, SamplingParams, autodeploy
from autodeploy.cli.main import main
from autodeploy.errors import ConfigError, InvalidRequestError, WorkerError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [7, 8, 9, 10]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_spawned_tensor_parallel_llm_serves_like_one_process_and_shuts_down_clean(tiny_checkpoint):
    directory = str(tiny_checkpoint("qwen2"))
    single = autodeploy(directory, device="cpu")
    mixed = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (8, 3, 5)]
    want = _tokens(single.generate(PROMPTS, mixed))
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=7)
    want_sampled = _tokens(single.generate([PROMPTS[0]], sampled))
    llm = autodeploy(directory, device="cpu", tensor_parallel=2, distributed={"timeout_s": 120})
    try:
        (worker,) = llm.workers.processes
        assert worker.poll() is None
        assert _tokens(llm.generate(PROMPTS, mixed)) == want  # in-flight batching of mixed lengths
        assert _tokens(llm.generate([PROMPTS[0]], sampled)) == want_sampled  # seeded sampling alike on both ranks
        streamed = [chunk.outputs[0].new_token_ids for chunk in llm.stream(PROMPTS[0], GREEDY)]
        assert [t for new in streamed for t in new] == want[0]
        for got, expected in zip(llm.logits(PROMPTS[:2]), single.logits(PROMPTS[:2])):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

        async def serve() -> list[list[int]]:
            async_llm = AsyncLLM(llm)
            outputs = await asyncio.gather(*(async_llm.generate(p, s) for p, s in zip(PROMPTS, mixed)))
            async_llm.shutdown()
            return _tokens(outputs)

        assert asyncio.run(serve()) == want
        # A request aborted between steps is dropped on both ranks alike; the next batch still agrees.
        request = llm.engine.add_request(PROMPTS[1], GREEDY)
        llm.engine.abort(request.request_id)
        assert _tokens(llm.generate(PROMPTS, mixed)) == want
    finally:
        llm.shutdown()
    assert worker.poll() is not None  # the worker left
    with pytest.raises(InvalidRequestError, match="shut down"):
        llm.generate(PROMPTS[:1], GREEDY)


def test_a_worker_killed_mid_step_is_a_worker_error_at_once(tiny_checkpoint):
    # The worker dies while rank 0 waits for it in a collective: that step fails with a WorkerError naming it,
    # long before the collective timeout, and so does every later call, without waiting.
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", tensor_parallel=2, distributed={"timeout_s": 120})
    (worker,) = llm.workers.processes
    send_step = llm.workers.step

    def step_then_kill(commands):
        send_step(commands)
        os.kill(worker.pid, signal.SIGKILL)

    llm.workers.step = step_then_kill
    try:
        started = time.monotonic()
        with pytest.raises(WorkerError, match="worker rank 1 was killed by signal 9"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - started < 30
        with pytest.raises(WorkerError, match="cannot serve any more"):
            llm.generate(PROMPTS[:1], GREEDY)
    finally:
        llm.shutdown()
    assert worker.poll() is not None


def test_parallelism_the_model_cannot_take_is_refused_before_any_process_starts(tiny_checkpoint, monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    directory = str(tiny_checkpoint("llama"))  # 4 heads, 2 KV heads, 2 layers, no experts
    for overrides, message in (
        ({"tensor_parallel": 3}, r"tensor_parallel=3 must divide the attention heads \(4\)"),
        ({"pipeline_parallel": 3}, r"pipeline_parallel=3 must divide the layers \(2\)"),
        ({"expert_parallel": 2}, "has no MoE experts"),
        ({"tensor_parallel": 2, "expert_parallel": 4}, "each must be 1 or the other's value"),
    ):
        with pytest.raises(ConfigError, match=message):
            autodeploy(directory, device="cpu", **overrides)


def test_autodeploy_run_with_pp_spawns_its_worker_and_prints_one_completion(tiny_checkpoint, capsys, monkeypatch):
    # Pipeline parallel through the CLI: the spawned worker holds the second layer. Both runs are this process's
    # (rank 0 of the second, as `autodeploy run --pp 2` is in a plain process): an interpreter of rank 0's own would
    # import torch again, and `python -m autodeploy` is run by tests/cli and the torchrun test.
    directory = str(tiny_checkpoint("llama"))
    argv = ["run", directory, "--prompt", "def f(", "--max-tokens", "6", "--set", "device=cpu"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    spawned = []
    popen = subprocess.Popen

    def record(*args, **kwargs):
        spawned.append(popen(*args, **kwargs))
        return spawned[-1]

    monkeypatch.setattr(subprocess, "Popen", record)
    assert main([*argv, "--pp", "2"]) == 0
    assert capsys.readouterr().out == single and single.strip()
    assert len(spawned) == 1 and spawned[0].poll() is not None  # its worker, gone once the run returned
    assert not torch.distributed.is_initialized()  # and the process group left


def test_a_stuck_worker_is_a_worker_error_after_the_collective_timeout(tiny_checkpoint):
    # The worker is stopped (SIGSTOP), not dead: rank 0's collective waits distributed.timeout_s, then fails
    # with a WorkerError saying so, and the stuck worker is killed.
    timeout = 30
    llm = autodeploy(str(tiny_checkpoint("llama")), device="cpu", tensor_parallel=2, distributed={"timeout_s": timeout})
    (worker,) = llm.workers.processes
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerError, match=f"waited more than distributed.timeout_s={timeout} s"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert timeout <= time.monotonic() - started < timeout + 30
        assert worker.poll() is not None
    finally:
        llm.shutdown()
