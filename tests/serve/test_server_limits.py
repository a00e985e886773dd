"""The server under hostile load: bursts past ``max_queued_requests``, bodies past ``max_request_bytes``, prompts
too long to tokenize; and the event loop stays free while a prompt is tokenized."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time

import httpx
import pytest

from autodeploy import autodeploy
from autodeploy.serve import ServerOptions, build_app
from autodeploy.serve.server import serving_in_thread
from tests.serve.test_openai_server import CHAT_TEMPLATE, metric

MODEL = "tiny-llama"


@contextlib.contextmanager
def serving(llm, **options):
    with serving_in_thread(build_app(llm, ServerOptions(served_model_name=MODEL, **options))) as base:
        yield base


def completion(base: str, prompt, max_tokens: int = 4, timeout: float = 60.0) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def four_seat_llm(llama_dir):
    return autodeploy(str(llama_dir), device="cpu", max_batch_size=4)


def test_a_burst_is_admitted_up_to_the_free_seats_and_the_queue_limit(four_seat_llm):
    """24 requests at once while no step runs: the 4 seats and 1 queue place are taken, the other 19 get a 503
    (before the fix, admission read the queue before the burst's requests were in it and let 23 through)."""
    engine = four_seat_llm.engine
    with serving(four_seat_llm, max_queued_requests=1, queue_timeout_s=0) as base, concurrent.futures.ThreadPoolExecutor(24) as pool:
        with engine._step_lock:  # the engine is paused: nothing is scheduled while the burst arrives
            futures = [pool.submit(completion, base, [5, 6, i + 7], 8) for i in range(24)]
            refused: list = []
            while len(refused) < 19 and not any(f.done() and f.exception() for f in futures):
                time.sleep(0.05)
                refused = [f for f in futures if f.done() and not f.exception() and f.result().status_code == 503]
        statuses = sorted(f.result().status_code for f in futures)
        assert metric(base, "autodeploy_requests_rejected_total") == 19
    assert statuses == [200] * 5 + [503] * 19, statuses
    refused = next(f.result() for f in futures if f.result().status_code == 503)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "queue_full"
    assert "1 requests are waiting for a seat (--max-queued-requests 1)" in refused.json()["error"]["message"]
    assert all(f.result().json()["usage"]["completion_tokens"] == 8 for f in futures if f.result().status_code == 200)
    assert not engine.has_unfinished()


def test_beyond_the_queue_requests_wait_in_the_lobby_in_order_then_time_out(four_seat_llm, monkeypatch):
    """With room for 4 running and 1 queued, 8 requests at once: 5 are admitted and 3 wait in the lobby (no 503, no
    retry storm); each gets in as one ahead of it leaves, first come first served. With the engine paused longer than
    the queue timeout, the waiting ones get the 503 instead."""
    engine = four_seat_llm.engine
    submitted = []  # each request's last prompt token, in the order the engine got them
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request: (submitted.append(request.prompt_token_ids[-1]), submit(request)))
    with serving(four_seat_llm, max_queued_requests=1, queue_timeout_s=60) as base, concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = []
        with engine._step_lock:  # paused while they arrive, one after another
            for i in range(8):
                futures.append(pool.submit(completion, base, [5, 6, i + 7], 8))
                wait_until(lambda: len(engine.requests) + lobby_size(base) == i + 1)
            assert len(engine.requests) == 5 and lobby_size(base) == 3
        answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * 8
        assert metric(base, "autodeploy_requests_rejected_total") == 0
        assert submitted[5:] == [12, 13, 14]  # the lobby's, first come first served
    with serving(four_seat_llm, max_queued_requests=1, queue_timeout_s=0.5) as base, concurrent.futures.ThreadPoolExecutor(8) as pool:
        with engine._step_lock:
            futures = [pool.submit(completion, base, [5, 6, i + 7], 8) for i in range(8)]
            wait_until(lambda: sum(f.done() for f in futures) == 3)
        statuses = sorted(f.result().status_code for f in futures)
        assert statuses == [200] * 5 + [503] * 3, statuses
        refused = next(f.result() for f in futures if f.result().status_code == 503).json()["error"]["message"]
        assert "none left in 0.5 s (--queue-timeout)" in refused
    assert not engine.has_unfinished()


def lobby_size(base: str) -> int:
    return int(metric(base, "autodeploy_requests_waiting_for_room"))


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_bodies_over_the_limit_are_413_before_they_are_read(llama_llm):
    with serving(llama_llm, max_request_bytes=4096) as base:
        declared = completion(base, "x" * 5000)
        assert declared.status_code == 413 and "--max-request-bytes" in declared.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it arrives
            yield b'{"model": "tiny-llama", "prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        chunked = httpx.post(f"{base}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}, timeout=60)
        assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "invalid_request_error"
        assert completion(base, "import os").status_code == 200  # and the server still serves


def test_a_prompt_longer_than_any_context_is_refused_without_tokenizing(llama_llm, monkeypatch):
    engine = llama_llm.engine
    calls = []
    tokenizer = engine.tokenizer
    monkeypatch.setattr(engine, "tokenizer", _Spy(tokenizer, calls))
    with serving(llama_llm, chat_template=CHAT_TEMPLATE) as base:
        response = completion(base, "hello world " * 400_000)  # 4.8 MB
        assert response.status_code == 400 and "characters" in response.json()["error"]["message"]
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hello " * 800_000}]})
        assert chat.status_code == 400 and "characters" in chat.json()["error"]["message"]
    assert calls == []


def test_the_event_loop_answers_while_a_prompt_is_tokenized(llama_llm, monkeypatch):
    """Tokenizing runs in a worker thread: /health answers while a (here: held) tokenization is in progress."""
    engine = llama_llm.engine
    release = threading.Event()
    monkeypatch.setattr(engine, "tokenizer", _Spy(engine.tokenizer, [], hold=release))
    with serving(llama_llm) as base:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(completion, base, "def add(a, b):")
            try:
                assert httpx.get(f"{base}/health", timeout=10).status_code == 200
            finally:
                release.set()
            assert pending.result().status_code == 200


class _Spy:
    """The tokenizer, recording each call to it (and holding it until ``hold`` is set)."""

    def __init__(self, tokenizer, calls: list, hold: threading.Event | None = None):
        self._tokenizer, self._calls, self._hold = tokenizer, calls, hold

    def __call__(self, text, **kwargs):
        self._calls.append(len(text))
        if self._hold is not None:
            self._hold.wait(60)
        return self._tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)
