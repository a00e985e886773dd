"""Workload construction: seeded prompts, Poisson arrivals at the requested rate, and bad inputs
rejected before anything runs."""

from __future__ import annotations

import json
import math

import pytest

from autodeploy.bench.workloads import (
    LengthDistribution,
    load_dataset,
    poisson_arrivals,
    realistic_requests,
    synthetic_workload,
)
from autodeploy.errors import ConfigError


def test_poisson_arrivals_have_the_requested_rate():
    rate, count = 5.0, 4000
    times = poisson_arrivals(count, rate, seed=3)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    estimated = count / times[-1]
    assert abs(estimated - rate) < 3 * rate / math.sqrt(count)  # 3 standard errors
    # Exponential gaps: Kolmogorov–Smirnov distance to 1 − e^(−rate·t) below the 1% critical value.
    ordered = sorted(gaps)
    distance = max(max(abs((i + 1) / count - (1 - math.exp(-rate * g))), abs(i / count - (1 - math.exp(-rate * g)))) for i, g in enumerate(ordered))
    assert distance < 1.63 / math.sqrt(count)
    # Counts per unit interval: a Poisson process has variance equal to its mean.
    counts = [0] * int(times[-1])
    for t in times:
        if int(t) < len(counts):
            counts[int(t)] += 1
    mean = sum(counts) / len(counts)
    variance = sum((c - mean) ** 2 for c in counts) / (len(counts) - 1)
    assert 0.8 < variance / mean < 1.2
    assert poisson_arrivals(10, rate, seed=3) == times[:10]  # seeded


@pytest.mark.parametrize("rate", [0, -1.5])
def test_non_positive_rates_are_rejected(rate):
    with pytest.raises(ConfigError, match="rate must be > 0"):
        poisson_arrivals(4, rate)


def test_synthetic_prompts_are_seeded_and_exact():
    a = synthetic_workload(3, 7, 5, vocab_size=100, max_seq_len=64, seed=1)
    b = synthetic_workload(3, 7, 5, vocab_size=100, max_seq_len=64, seed=1)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert all(len(r.prompt_token_ids) == 7 and r.output_len == 5 for r in a.requests)
    assert a.id == "synthetic/b3-in7-out5"


def test_lengths_beyond_max_seq_len_are_rejected_up_front():
    with pytest.raises(ConfigError, match="max_seq_len=64"):
        synthetic_workload(1, 32, 40, vocab_size=100, max_seq_len=64)
    with pytest.raises(ConfigError, match="max_seq_len"):
        realistic_requests(4, "uniform:8:16", "fixed:100", vocab_size=100, max_seq_len=64)


@pytest.mark.parametrize("spec", ["gauss:1:2", "uniform:9:3", "fixed", "fixed:x", "uniform:-1:4", "fixed:0"])
def test_bad_length_distributions(spec):
    with pytest.raises(ConfigError):
        LengthDistribution(spec)


def test_length_distributions_stay_in_range():
    import random

    rng = random.Random(0)
    assert {LengthDistribution("fixed:9").sample(rng) for _ in range(5)} == {9}
    assert all(3 <= LengthDistribution("uniform:3:6").sample(rng) <= 6 for _ in range(100))
    assert all(LengthDistribution("normal:5:10").sample(rng) >= 1 for _ in range(100))


def test_dataset_files(tmp_path):
    good = tmp_path / "prompts.jsonl"
    good.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "output_len": 4}) + "\n\n" + json.dumps({"prompt_token_ids": [5]}) + "\n")
    assert load_dataset(good, None, vocab_size=10) == [([1, 2, 3], 4), ([5], None)]
    requests = realistic_requests(3, "fixed:1", "fixed:2", vocab_size=10, max_seq_len=64, dataset=good)
    assert [(r.prompt_token_ids, r.output_len) for r in requests] == [([1, 2, 3], 4), ([5], 2), ([1, 2, 3], 4)]

    cases = {
        "prompts.csv": ("a,b\n", "unknown format"),
        "empty.jsonl": ("\n", "is empty"),
        "broken.jsonl": ("{not json\n", "broken.jsonl:1 is not valid JSON"),
        "fields.jsonl": ('{"text": "x"}\n', 'needs a "prompt"'),
        "ids.jsonl": ('{"prompt_token_ids": [99]}\n', "prompt_token_ids must be"),
        "text.jsonl": ('{"prompt": "hello"}\n', "no tokenizer"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_text(content)
        with pytest.raises(ConfigError, match=message):
            load_dataset(path, None, vocab_size=10)
    with pytest.raises(ConfigError, match="does not exist"):
        load_dataset(tmp_path / "missing.jsonl", None, vocab_size=10)


def test_the_engine_is_sized_for_the_largest_point_unless_the_user_says_otherwise(tmp_path):
    from autodeploy.bench.benchmark import BenchmarkConfig, _sized_for_workloads

    assert _sized_for_workloads(BenchmarkConfig(batch=[1, 32, 256])) == ["max_batch_size=256"]
    assert _sized_for_workloads(BenchmarkConfig(batch=[1, 8], set_arguments=["dtype=float32"])) == ["dtype=float32"]
    concurrency = BenchmarkConfig(workloads=["concurrency"], concurrency=[64], batch=[512])
    assert _sized_for_workloads(concurrency) == ["max_batch_size=64"]
    assert _sized_for_workloads(BenchmarkConfig(batch=[256], set_arguments=["max_batch_size=16"])) == ["max_batch_size=16"]
    config_file = tmp_path / "site.yaml"
    config_file.write_text("max_batch_size: 48\n")
    assert _sized_for_workloads(BenchmarkConfig(batch=[256], config_files=[str(config_file)])) == []
