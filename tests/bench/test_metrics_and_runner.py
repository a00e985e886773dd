"""Benchmark metrics on a synthetic clock: the TTFT/TPOT/ITL/E2E and throughput math, exactly."""

from __future__ import annotations

import pytest

from autodeploy.bench.metrics import RequestTiming, distribution, headline_values, percentile, summarize
from autodeploy.bench.runner import run_workload
from autodeploy.bench.workloads import BenchRequest, Workload, concurrency_workload, synthetic_workload


def test_percentiles_interpolate_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5 and percentile(values, 90) == pytest.approx(3.7)
    assert distribution([]) is None


def test_summary_of_hand_made_timings():
    timings = [
        RequestTiming(arrival=0.0, token_times=[0.5, 0.7, 0.9], input_len=10),
        RequestTiming(arrival=1.0, token_times=[1.2], input_len=4),
    ]
    m = summarize(timings)
    assert m["ttft_s"]["mean"] == pytest.approx(0.35) and m["ttft_s"]["p50"] == pytest.approx(0.35)
    assert m["e2e_s"]["p50"] == pytest.approx(0.55)
    assert m["tpot_s"]["mean"] == pytest.approx(0.2)  # the one-token request has no TPOT
    assert m["itl_s"]["p99"] == pytest.approx(0.2)
    assert m["duration_s"] == pytest.approx(1.2)
    assert m["output_tokens_per_s"] == pytest.approx(4 / 1.2) and m["total_tokens_per_s"] == pytest.approx(18 / 1.2)
    assert m["requests_per_s"] == pytest.approx(2 / 1.2)
    assert set(headline_values(m)) == {
        "output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_s", "e2e_p50_s",
    }


class FakeClock:
    """Time moves only when the model runs a forward (10 ms each) or the runner waits."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clocked_llm(llama_llm, monkeypatch):
    clock = FakeClock()
    engine = llama_llm.engine
    graph = engine.graph

    def timed_forward(*inputs):
        clock.now += 0.010
        return graph(*inputs)

    monkeypatch.setattr(engine, "graph", timed_forward)
    # The fake clock charges a forward when it is launched; overlapped, a step's tokens are applied after
    # the next one is launched, so they would look one forward late. Lockstep keeps the arithmetic exact.
    monkeypatch.setattr(engine, "overlap", False)
    return llama_llm, clock


def test_synthetic_run_on_a_fake_clock_gives_exact_metrics(clocked_llm):
    llm, clock = clocked_llm
    workload = synthetic_workload(2, input_len=5, output_len=4, vocab_size=llm.vocab_size, max_seq_len=512)
    m = summarize(run_workload(llm, workload, clock=clock, wait=clock.wait, progress=False).timings)
    # forward 1 prefills both prompts (first tokens at +10 ms); forwards 2-4 decode one token each.
    assert m["ttft_s"]["p50"] == pytest.approx(0.010) and m["ttft_s"]["p99"] == pytest.approx(0.010)
    assert m["tpot_s"]["mean"] == pytest.approx(0.010) and m["itl_s"]["p99"] == pytest.approx(0.010)
    assert m["e2e_s"]["p50"] == pytest.approx(0.040)
    assert m["output_tokens_per_s"] == pytest.approx(8 / 0.040)
    assert m["total_tokens_per_s"] == pytest.approx(18 / 0.040)


def test_arrivals_are_scheduled_times_and_concurrency_is_capped(clocked_llm):
    llm, clock = clocked_llm
    requests = [BenchRequest([5, 6, 7], 3, arrival=0.0), BenchRequest([8, 9], 3, arrival=1.0)]
    description = {"num_requests": 2, "input_len": "fixed:3", "output_len": "fixed:3", "rate": 1.0}
    measurement = run_workload(llm, Workload("poisson", requests, description), clock=clock, wait=clock.wait, progress=False)
    first, second = measurement.timings
    assert second.arrival == pytest.approx(first.arrival + 1.0)
    assert second.ttft == pytest.approx(0.010)  # it arrived to an idle engine: one forward
    capped = concurrency_workload([BenchRequest([5, 6, 7], 2) for _ in range(3)], 1, {**description, "num_requests": 3})
    timings = run_workload(llm, capped, clock=clock, wait=clock.wait, progress=False).timings
    assert [round(t.ttft, 3) for t in timings] == [0.010] * 3  # each sent when the previous finished
    assert [round(t.arrival - timings[0].arrival, 3) for t in timings] == [0.0, 0.020, 0.040]
    assert llm.engine.pool.num_used_blocks == 0
