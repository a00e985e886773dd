"""Disaggregated serving on loopback: prefill and decode workers, the KV transfer between them, and the router.

Every answer through the router is held to the same request's answer from one plain server over the same tiny
Llama (greedy and seeded, streamed and not); then the faults: corrupted payloads, a hold that is gone, a worker
of another model, and (``test_killed_workers``) decode and prefill worker processes killed by PID mid-run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from autodeploy import autodeploy
from autodeploy.errors import ConfigError
from autodeploy.serve import ServerOptions, build_app
from autodeploy.serve.disagg.router import RouterOptions, WorkerPool, build_router_app
from autodeploy.serve.disagg.transfer import CORRUPT_ENV, TransferError, receive
from autodeploy.serve.disagg.worker import KV_HEADER, WorkerOptions, check_role
from autodeploy.serve.server import serving_in_thread
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.serve.disagg.registry import RegistryError
from tests.etcd_server import EtcdServer, etcd_or_skip, free_ports
from tests.serve.test_openai_server import CHAT_TEMPLATE

PROMPT = "def fibonacci(n): return fibonacci(n - 1) + fibonacci(n - 2) if n > 1 else n  # the classic, slow and exact"
REQUESTS = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}),
    ("/v1/completions", {"prompt": PROMPT + " again", "max_tokens": 10, "temperature": 1.0, "seed": 7}),
    ("/v1/completions", {"prompt": [PROMPT, "import os"], "max_tokens": 6, "temperature": 0.8, "seed": 3, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 9, "temperature": 0.7, "seed": 11,
                              "logprobs": True, "top_logprobs": 2}),
]


@pytest.fixture(scope="module")
def saved(llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama saved (workers load it in a blink, in process or as processes)."""
    directory = tmp_path_factory.mktemp("disagg-llama")
    autodeploy(str(llama_dir), device="cpu").save(directory)
    return directory


def _app(saved: Path, role: str | None = None, **worker) -> tuple:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    disagg = WorkerOptions(role=role, url=url, **worker) if role else None
    return build_app(autodeploy(str(saved)), ServerOptions("tiny", chat_template=CHAT_TEMPLATE, disagg=disagg)), sock


@pytest.fixture(scope="module")
def cluster(saved):
    """A plain server (the reference), two prefill and two decode workers in this process, and a router over them."""
    with contextlib.ExitStack() as stack:
        def serve(role=None, **worker):
            app, sock = _app(saved, role, **worker)
            return stack.enter_context(serving_in_thread(app, sock=sock))

        reference = serve()
        prefill = [serve("prefill") for _ in range(2)]
        decode = [serve("decode") for _ in range(2)]
        router = stack.enter_context(serving_in_thread(build_router_app(RouterOptions(prefill=prefill, decode=decode, poll_s=0.2))))
        yield {"reference": reference, "prefill": prefill, "decode": decode, "router": router}


def _answer(url: str, path: str, body: dict, timeout: float = 60) -> dict:
    response = httpx.post(f"{url}{path}", json={"model": "tiny", **body}, timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()


def _streamed(url: str, path: str, body: dict, timeout: float = 60, began: threading.Event | None = None) -> dict[int, str]:
    """Each choice's streamed text, in order (``began`` is set at its first event)."""
    texts: dict[int, str] = {}
    with httpx.stream("POST", f"{url}{path}", json={"model": "tiny", **body, "stream": True}, timeout=timeout) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            if began is not None:
                began.set()
            for choice in event["choices"]:
                assert "autodeploy" not in choice
                piece = choice.get("text") if "text" in choice else (choice["delta"].get("content") or "")
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


def _response_text(events: str) -> str:
    """The text of a streamed Responses API answer (its output_text deltas)."""
    deltas = [json.loads(line[len("data: "):]) for line in events.splitlines() if line.startswith("data: {")]
    return "".join(event.get("delta", "") for event in deltas if event.get("type") == "response.output_text.delta")


def _without_ids(answer: dict) -> dict:
    return {key: value for key, value in answer.items() if key not in ("id", "created")}


def _transfers(urls: list[str]) -> dict:
    totals: dict[str, int] = {}
    for url in urls:
        for key, value in httpx.get(f"{url}/disagg/load").json()["transfers"].items():
            totals[key] = totals.get(key, 0) + value
    return totals


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path,body", REQUESTS, ids=["greedy", "seeded", "two-prompts-n2", "chat-logprobs"])
def test_router_answers_as_one_server(cluster, path, body):
    before = _transfers(cluster["decode"])
    assert _without_ids(_answer(cluster["router"], path, body)) == _without_ids(_answer(cluster["reference"], path, body))
    assert _streamed(cluster["router"], path, body) == _streamed(cluster["reference"], path, body)
    after = _transfers(cluster["decode"])
    assert after["received_blocks"] + after["cached_blocks"] > before["received_blocks"] + before["cached_blocks"]
    assert after["failed"] == before["failed"]


@pytest.mark.timeout(120)
def test_router_health_metrics_and_other_routes(cluster):
    health = httpx.get(f"{cluster['router']}/health").json()
    assert health["workers"] == {"prefill": 2, "decode": 2} and health["status"] == "ok"
    assert httpx.get(f"{cluster['router']}/v1/models").json()["data"][0]["id"] == "tiny"
    response = {"model": "tiny", "input": PROMPT, "max_output_tokens": 6, "temperature": 0, "stream": True}
    streamed = [httpx.post(f"{url}/v1/responses", json=response, timeout=60) for url in (cluster["router"], cluster["reference"])]
    assert [r.headers["content-type"].split(";")[0] for r in streamed] == ["text/event-stream"] * 2
    assert _response_text(streamed[0].text) == _response_text(streamed[1].text) != ""
    bad = httpx.post(f"{cluster['router']}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": -1})
    assert bad.status_code == 400 and "max_tokens" in bad.text
    metrics = httpx.get(f"{cluster['router']}/metrics").text
    assert 'autodeploy_router_live_workers{role="decode"} 2.0' in metrics


@pytest.mark.timeout(120)
def test_worker_headers_on_a_plain_server_and_a_prefill_worker(cluster):
    plain = httpx.post(f"{cluster['reference']}/v1/completions", json={"model": "tiny", "prompt": "x"}, headers={KV_HEADER: "[]"})
    assert plain.status_code == 400 and "--role" in plain.text
    prefill = httpx.post(f"{cluster['prefill'][0]}/v1/completions", json={"model": "tiny", "prompt": "x"}, headers={KV_HEADER: "[]"})
    assert prefill.status_code == 400 and "decode worker" in prefill.text
    garbled = httpx.post(f"{cluster['decode'][0]}/v1/completions", json={"model": "tiny", "prompt": "x"}, headers={KV_HEADER: "{"})
    assert garbled.status_code == 400 and KV_HEADER in garbled.text
    bad_keys = json.dumps([{"source": "x:1", "transfer_id": "t", "keys": ["not hex"], "fingerprint": "f"}])
    assert httpx.post(f"{cluster['decode'][0]}/v1/completions", json={"model": "tiny", "prompt": "x"},
                      headers={KV_HEADER: bad_keys}).status_code == 400
    decoding = httpx.post(f"{cluster['decode'][0]}/v1/completions", json={"model": "tiny", "prompt": "x"},
                          headers={"x-autodeploy-disagg": "prefill"})
    assert decoding.status_code == 400 and "prefill worker" in decoding.text


def test_the_pool_balances_by_load_keeps_prefixes_together_and_skips_the_down():
    pool = WorkerPool(affinity_slack=1.5)
    pool.update("p1", "prefill", "fp", {"queued_prompt_tokens": 900})
    pool.update("p2", "prefill", "fp", {"queued_prompt_tokens": 100})
    pool.update("d1", "decode", "fp", {"kv_usage": 0.5, "running": 3})
    pool.update("d2", "decode", "fp", {"kv_usage": 0.1, "running": 1})
    pool.settle_fingerprint(["another", "fp", "fp"])  # the most common; already settled by the first update, unchanged
    pool.update("x", "decode", "another", {})
    assert "x" in pool.refused and pool.fingerprint == "fp"
    fresh = WorkerPool()
    fresh.settle_fingerprint(["another", "fp", None, "fp"])
    assert fresh.fingerprint == "fp" and pool.counts() == {"prefill": 2, "decode": 2}
    assert pool.choose("prefill", "a", set(), cost=500).url == "p2"  # 100 waiting tokens against 900
    assert pool.choose("prefill", "b", set(), cost=500).url == "p2"  # 600 now, still less than 900
    assert pool.choose("prefill", "c", set(), cost=500).url == "p1"  # 1,100 against 900
    assert pool.choose("prefill", "c", set(), cost=10).url == "p1"  # c's prefix is on p1: 1,400 ≤ 1.5 × 1,100 + 1
    pool.update("p1", "prefill", "fp", {"queued_prompt_tokens": 5000})
    assert pool.choose("prefill", "c", set(), cost=10).url == "p2"  # too busy now: 5,000 > 1.5 × 1,100 + 1
    assert pool.choose("decode", "a", set(), cost=1).url == "d2"
    assert pool.choose("decode", "a", {"d2"}, cost=1).url == "d1"  # tried already
    pool.down("d2", 60)
    assert pool.choose("decode", "z", set(), cost=1).url == "d1" and pool.counts()["decode"] == 1
    pool.update("d2", "decode", "fp", {})  # seen alive again
    assert pool.counts()["decode"] == 2
    pool.keep_only({"p1", "d1"})
    assert pool.counts() == {"prefill": 1, "decode": 1}


def _held_prompt(engine, prompt: list[int]) -> list[bytes]:
    engine.pool.reset_prefix_cache()
    list(_generate(engine, prompt, SamplingParams(max_tokens=1)))
    return engine.handoff.hold("t", prompt)


def _generate(engine, prompt, params):
    request = engine.add_request(prompt, params)
    while not request.finished:
        engine.step()
    return request.sequences[0].output_token_ids


@pytest.mark.timeout(120)
def test_handoff_moves_exactly_the_blocks_the_receiver_lacks(saved):
    sender, receiver = autodeploy(str(saved)).engine, autodeploy(str(saved)).engine
    prompt = list(range(3, 3 + 5 * sender.pool.block_size + 3))
    expected = _generate(sender, prompt, SamplingParams(max_tokens=6))
    keys = _held_prompt(sender, prompt)
    assert len(keys) == 5
    payloads = dict(sender.handoff.payloads("t"))
    first = receiver.handoff.adopt("r1", keys[:2])  # the receiver has the first two blocks already
    assert receiver.handoff.write("r1", keys[:2], {i: payloads[i] for i in first}) == 2
    new = receiver.handoff.adopt("r2", keys)
    assert new == [2, 3, 4] and dict(sender.handoff.payloads("t", skip=set(keys[:2]))).keys() == {2, 3, 4}
    assert receiver.handoff.write("r2", keys, {2: payloads[2], 4: payloads[4]}) == 3  # block 3 lost: the run ends before it
    hits = receiver.pool.stats.hit_tokens
    assert _generate(receiver, prompt, SamplingParams(max_tokens=6)) == expected
    assert receiver.pool.stats.hit_tokens - hits == 3 * receiver.pool.block_size
    with pytest.raises(ValueError, match="bytes"):
        receiver.handoff.adopt("r3", keys[:1] + [b"x" * 16])
        receiver.handoff.write("r3", keys[:1] + [b"x" * 16], {1: b"short"})
    assert sender.handoff.release("t") and not sender.handoff.release("t")
    sender.handoff.hold("late", prompt, ttl_s=0)
    assert sender.handoff.expire() == ["late"] and sender.handoff.held == 0


@pytest.mark.timeout(120)
def test_a_hold_released_while_its_blocks_are_written(saved, monkeypatch):
    """The receiver writes outside the engine's lock: a release (or expiry) meanwhile leaves the blocks to the writer,
    which frees them when done and publishes nothing — no other sequence gets a block still being written."""
    sender, receiver = autodeploy(str(saved)).engine, autodeploy(str(saved)).engine
    prompt = list(range(3, 3 + 2 * sender.pool.block_size + 3))
    keys = _held_prompt(sender, prompt)
    payloads = dict(sender.handoff.payloads("t"))
    free = receiver.pool.num_free_blocks
    new = receiver.handoff.adopt("r", keys)
    write = receiver.handoff._write_blocks

    def released_meanwhile(writes):
        assert receiver.handoff.release("r") and receiver.handoff.expire(now=float("inf")) == []
        assert receiver.pool.num_free_blocks == free - len(new)  # still the writer's
        write(writes)

    monkeypatch.setattr(receiver.handoff, "_write_blocks", released_meanwhile)
    assert receiver.handoff.write("r", keys, payloads) == 0
    assert receiver.pool.num_free_blocks == free and receiver.pool.cached_keys(keys) == set()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_handoff_on_the_gpu(llama_dir, monkeypatch, dtype):
    """The blocks of a prompt computed on the GPU, pulled over gRPC through shared memory into another engine on the GPU:
    that engine generates what it would have from its own prefill."""
    import torch
    from autodeploy.serve.disagg import transfer
    from autodeploy.serve.disagg.transfer import KVTransferService, start_transfer_server

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(transfer, "SHARED_MEMORY_MIN_BYTES", 0)
    sender, receiver = (autodeploy(str(llama_dir), device="cuda", dtype=dtype, kv_cache={"num_blocks": 64}).engine for _ in range(2))
    prompt = list(range(3, 3 + 5 * sender.pool.block_size + 3))
    expected = _generate(receiver, prompt, SamplingParams(max_tokens=8))
    receiver.pool.reset_prefix_cache()
    keys = _held_prompt(sender, prompt)
    server, port = start_transfer_server(KVTransferService(sender.handoff, "same"), "127.0.0.1", 0)
    try:
        result = receive(receiver.handoff, "r", f"127.0.0.1:{port}", "t", keys, "same", timeout_s=10, same_node=True)
    finally:
        server.stop(grace=0).wait()
    assert result.usable == 5 and result.shared_memory and result.error is None
    hits = receiver.pool.stats.hit_tokens
    assert _generate(receiver, prompt, SamplingParams(max_tokens=8)) == expected
    assert receiver.pool.stats.hit_tokens - hits == 5 * receiver.pool.block_size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("corrupted,written,shared", [(1, 5, False), (1, 5, True), (1000, 0, True)],
                         ids=["retried", "retried-shared-memory", "given-up"])
def test_corrupted_payloads_are_never_used(saved, monkeypatch, corrupted, written, shared):
    """A payload that fails its checksum is asked for again; one that keeps failing is computed by the receiver. Through
    the socket and through shared memory (on one node, for payloads of any size here)."""
    from autodeploy.serve.disagg import transfer
    from autodeploy.serve.disagg.transfer import KVTransferService, start_transfer_server

    monkeypatch.setenv(CORRUPT_ENV, str(corrupted))
    monkeypatch.setattr(transfer, "SHARED_MEMORY_MIN_BYTES", 0)
    sender, receiver = autodeploy(str(saved)).engine, autodeploy(str(saved)).engine
    prompt = list(range(3, 3 + 5 * sender.pool.block_size + 3))
    expected = _generate(receiver, prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=5))
    receiver.pool.reset_prefix_cache()
    keys = _held_prompt(sender, prompt)
    server, port = start_transfer_server(KVTransferService(sender.handoff, "same"), "127.0.0.1", 0)
    try:
        with pytest.raises(TransferError, match="same model"):
            receive(receiver.handoff, "other", f"127.0.0.1:{port}", "t", keys, "another-model")
        result = receive(receiver.handoff, "r", f"127.0.0.1:{port}", "t", keys, "same", timeout_s=5, same_node=shared)
        _until(lambda: not sender.handoff.held, timeout_s=5)  # released once received
    finally:
        server.stop(grace=0).wait()
    assert result.written == written and result.usable == written and result.attempts == (2 if corrupted == 1 else 3)
    assert (result.error is None) == (written == 5) and result.shared_memory == shared
    assert _generate(receiver, prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=5)) == expected


@pytest.mark.timeout(120)
def test_a_released_hold_and_a_dead_source_leave_the_prompt_to_the_receiver(saved):
    receiver = autodeploy(str(saved)).engine
    keys = [bytes([i]) * 16 for i in range(3)]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    result = receive(receiver.handoff, "r", dead, "gone", keys, "same", timeout_s=2, retries=1)
    assert result.usable == 0 and "UNAVAILABLE" in result.error and receiver.pool.cached_keys(keys) == set()


def test_roles_refuse_what_they_cannot_hand_over(saved):
    llm = autodeploy(str(saved))
    check_role(llm, "decode")
    with pytest.raises(ConfigError, match="--role"):
        check_role(llm, "middle")
    no_prefix = autodeploy(str(saved), kv_cache={"prefix_caching": False})
    with pytest.raises(ConfigError, match="prefix_caching"):
        check_role(no_prefix, "prefill")


@pytest.mark.timeout(180)
def test_a_worker_of_another_model_is_refused(saved, tiny_checkpoint, tmp_path):
    other_dir = tmp_path / "other"
    autodeploy(str(tiny_checkpoint("qwen2")), device="cpu").save(other_dir)
    with contextlib.ExitStack() as stack:
        def serve(directory, role):
            app, sock = _app(directory, role)
            return stack.enter_context(serving_in_thread(app, sock=sock))

        prefill, decode, other = serve(saved, "prefill"), serve(saved, "decode"), serve(other_dir, "decode")
        router = stack.enter_context(serving_in_thread(build_router_app(RouterOptions(prefill=[prefill], decode=[decode, other]))))
        _until(lambda: httpx.get(f"{router}/health").json()["workers"] == {"prefill": 1, "decode": 1})  # polled each second
        assert other in httpx.get(f"{router}/health").json()["refused"]
        transfers = httpx.post(f"{prefill}/v1/completions", json={"model": "tiny", "prompt": PROMPT},
                               headers={"x-autodeploy-disagg": "prefill"}).json()["kv_transfer"]
        refused = httpx.post(f"{other}/v1/completions", json={"model": "tiny", "prompt": PROMPT},
                             headers={KV_HEADER: json.dumps(transfers)})
        assert refused.status_code == 409 and "same model" in refused.text


@pytest.mark.timeout(240)
def test_workers_found_in_etcd_through_its_restart(saved, tmp_path, cluster):
    """Workers register in a real etcd and the router finds them there; with etcd stopped the router serves the workers
    it knows, and once etcd is back the workers are in it again; a worker that stops leaves it."""
    etcd = EtcdServer(tmp_path, etcd_or_skip())
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.5, "seed": 1}
    expected = _without_ids(_answer(cluster["reference"], "/v1/completions", body))
    try:
        with contextlib.ExitStack() as stack:
            def serve(role):
                app, sock = _app(saved, role, etcd=etcd.endpoint, heartbeat_ttl_s=2)
                return stack.enter_context(serving_in_thread(app, sock=sock))

            serve("prefill")
            decode = contextlib.ExitStack()
            app, sock = _app(saved, "decode", etcd=etcd.endpoint, heartbeat_ttl_s=2)
            decode.enter_context(serving_in_thread(app, sock=sock))
            router = stack.enter_context(serving_in_thread(build_router_app(RouterOptions(etcd=etcd.endpoint)), startup_timeout_s=30))
            _until(lambda: httpx.get(f"{router}/health").json()["workers"] == {"prefill": 1, "decode": 1})
            assert _without_ids(_answer(router, "/v1/completions", body)) == expected
            etcd.stop()
            _until(lambda: "unreachable" in httpx.get(f"{router}/health").json()["registry"])
            assert _without_ids(_answer(router, "/v1/completions", body)) == expected
            etcd.start()
            _until(lambda: httpx.get(f"{router}/health").json()["registry"] == "ok")
            assert httpx.get(f"{router}/health").json()["workers"] == {"prefill": 1, "decode": 1}
            decode.close()  # the worker leaves the registry as it shuts down
            _until(lambda: httpx.get(f"{router}/health").json()["workers"] == {"prefill": 1, "decode": 0})
            assert httpx.get(f"{router}/health").status_code == 503
    finally:
        etcd.stop()


def test_a_router_without_etcd_says_how_to_start_it():
    with pytest.raises(RegistryError, match="Start etcd"):
        build_router_app(RouterOptions(etcd=f"http://127.0.0.1:{free_ports(1)[0]}"))
    with pytest.raises(ConfigError, match="--etcd URL"):
        build_router_app(RouterOptions())


def _until(condition, timeout_s: float = 30.0, why=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"the condition never held {why()}"
        time.sleep(0.1)


# ---- worker processes killed by PID ------------------------------------------------------------
@contextlib.contextmanager
def _process(arguments: list[str], log: Path, port: int | None = None, ready: str = "/health"):
    """``autodeploy ARGUMENTS --port PORT`` as a process, once ``ready`` answers 200; yields it and its URL."""
    port = port or free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    with open(log, "ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "autodeploy", *arguments, "--port", str(port)], stdout=out,
                                   stderr=subprocess.STDOUT, env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"})
    try:
        _until(lambda: _answers(f"{url}{ready}") or process.poll() is not None, timeout_s=90)
        assert process.poll() is None, log.read_text()[-2000:]
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1).status_code == 200
    return False


def _worker(saved: Path, role: str, log: Path, port: int | None = None):
    return _process(["serve", str(saved), "--role", role, "--served-model-name", "tiny", "--kv-hold-timeout", "3"], log, port)


@pytest.mark.timeout(400)
def test_killed_workers_and_router(saved, tmp_path):
    """Two prefill and two decode worker processes behind a router process. A decode worker is killed (SIGKILL, by its
    PID) while it streams, then a prefill worker: every request completes once, each exactly as one server answers it.
    The decode worker started again on its port rejoins. The router killed mid-stream leaves nothing held in the
    workers, and a new router on its port serves at once; a decode worker stopped (SIGSTOP: hung) has its streams
    resumed elsewhere after the router's stall timeout."""
    bodies = [{"prompt": f"{PROMPT} #{i}", "max_tokens": 120, "temperature": 0.0 if i % 2 else 0.9, "seed": i, "ignore_eos": True}
              for i in range(12)]
    with contextlib.ExitStack() as stack:
        app, sock = _app(saved)
        reference = stack.enter_context(serving_in_thread(app, sock=sock))
        expected = [_streamed(reference, "/v1/completions", body) for body in bodies]
        workers = {name: stack.enter_context(_worker(saved, name.rstrip("12"), tmp_path / f"{name}.log"))
                   for name in ("prefill1", "prefill2", "decode1", "decode2")}
        urls = {name: url for name, (_, url) in workers.items()}
        router_arguments = ["router", "--prefill", urls["prefill1"], "--prefill", urls["prefill2"],
                            "--decode", urls["decode1"], "--decode", urls["decode2"], "--stall-timeout", "5"]
        router_process, router = stack.enter_context(_process(router_arguments, tmp_path / "router.log"))
        _until(lambda: httpx.get(f"{router}/health").json()["workers"] == {"prefill": 2, "decode": 2})
        results: dict[int, object] = {}
        began = {i: threading.Event() for i in range(12)}

        def run(index: int) -> None:
            try:
                results[index] = _streamed(router, "/v1/completions", bodies[index], timeout=120, began=began[index])
            except Exception as error:  # noqa: BLE001  (reported by the assertion below)
                results[index] = error

        first = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for thread in first:
            thread.start()
        _until(lambda: sum(began[i].is_set() for i in range(8)) >= 4, timeout_s=60)  # streaming, on both decode workers
        os.kill(workers["decode1"][0].pid, signal.SIGKILL)
        second = [threading.Thread(target=run, args=(i,)) for i in range(8, 12)]
        for thread in second:
            thread.start()
        os.kill(workers["prefill1"][0].pid, signal.SIGKILL)
        for thread in first + second:
            thread.join(timeout=180)
        metrics = httpx.get(f"{router}/metrics").text
        assert all(results.get(i) == expected[i] for i in range(12)), {i: results.get(i) for i in range(12) if results.get(i) != expected[i]}
        assert "autodeploy_router_resumed_streams_total 0.0" not in metrics  # decode1's streams went on elsewhere

        port = int(urls["decode1"].rsplit(":", 1)[1])
        stack.enter_context(_worker(saved, "decode", tmp_path / "decode1-again.log", port))
        _until(lambda: httpx.get(f"{router}/health").json()["workers"] == {"prefill": 1, "decode": 2})

        streaming = threading.Thread(target=run, args=(0,))
        results.pop(0)
        began[0].clear()
        streaming.start()
        _until(began[0].is_set)
        router_process.kill()
        streaming.join(timeout=60)
        assert isinstance(results[0], Exception)  # its client saw the router die
        for url in (urls["prefill2"], urls["decode1"], urls["decode2"]):  # nothing left running or held
            _until(lambda: (lambda load: load["running"] == load["waiting"] == load["held_transfers"] == 0)(
                httpx.get(f"{url}/disagg/load").json()["load"]))
        router_port = int(router.rsplit(":", 1)[1])
        stack.enter_context(_process(router_arguments, tmp_path / "router-again.log", router_port))
        assert _streamed(router, "/v1/completions", bodies[1]) == expected[1]

        failovers = _failovers(router)
        os.kill(workers["decode2"][0].pid, signal.SIGSTOP)  # hung, not dead: its streams stall
        try:
            hung = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for i, thread in enumerate(hung):
                results.pop(i, None)
                thread.start()
            for thread in hung:
                thread.join(timeout=120)
        finally:
            os.kill(workers["decode2"][0].pid, signal.SIGCONT)
        assert all(results.get(i) == expected[i] for i in range(4)), {i: results.get(i) for i in range(4)}
        assert _failovers(router) > failovers  # some went to the hung worker first


def _failovers(router: str) -> float:
    lines = httpx.get(f"{router}/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith('autodeploy_router_failovers_total{phase="decode"}'))
