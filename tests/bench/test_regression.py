"""Regression detection between two benchmark results, and the stability of the result file it reads."""

from __future__ import annotations

import doctest
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autodeploy.bench import regression
from autodeploy.bench.regression import MetricComparison, compare_results
from autodeploy.bench.results import HEADLINE_METRICS, BenchResult, RunResult, load_result
from autodeploy.errors import ConfigError

THROUGHPUTS = [m for m, higher_is_better in HEADLINE_METRICS.items() if higher_is_better]
LATENCIES = [m for m, higher_is_better in HEADLINE_METRICS.items() if not higher_is_better]
RUN_A = "synthetic/b8-in128-out128/autodeploy"
RUN_B = "synthetic/b1-in512-out64/autodeploy"

# Five repeats with about ±0.5% spread around each metric's typical value.
STEADY = (1.0, 1.004, 0.996, 1.002, 0.998)
TYPICAL = {
    "output_tokens_per_s": 1200.0,
    "total_tokens_per_s": 2400.0,
    "requests_per_s": 9.0,
    "ttft_p50_s": 0.05,
    "ttft_p99_s": 0.08,
    "tpot_p50_s": 0.012,
    "itl_p99_s": 0.02,
    "e2e_p50_s": 1.6,
}


def make_run(run_id: str, samples: dict[str, list[float]]) -> RunResult:
    repeats = max((len(values) for values in samples.values()), default=0)
    return RunResult(id=run_id, workload={"batch": 8}, engine="autodeploy", repeats=repeats, metrics={}, samples=samples)


def make_result(*runs: RunResult) -> BenchResult:
    return BenchResult(
        created="2026-11-30T21:00:00+00:00",
        machine={"device": "cpu", "device_name": "test", "torch": "2.13.0", "cpu_count": 2},
        model="tiny-llama",
        settings={"dtype": "float32"},
        build={"total_s": 4.1, "stages": {"export": 1.4}},
        runs=list(runs),
    )


def steady_samples(throughput_scale: float = 1.0, latency_scale: float = 1.0) -> dict[str, list[float]]:
    return {
        metric: [TYPICAL[metric] * (throughput_scale if HEADLINE_METRICS[metric] else latency_scale) * s for s in STEADY]
        for metric in HEADLINE_METRICS
    }


def verdicts(report: regression.RegressionReport) -> dict[tuple[str, str], str]:
    return {(c.run_id, c.metric): c.verdict for c in report.comparisons}


def one_metric(metric: str, base: list[float], current: list[float], **kwargs) -> MetricComparison:
    report = compare_results(make_result(make_run(RUN_A, {metric: base})), make_result(make_run(RUN_A, {metric: current})), **kwargs)
    (comparison,) = report.comparisons
    return comparison


def test_identical_results_are_unchanged():
    result = make_result(make_run(RUN_A, steady_samples()), make_run(RUN_B, steady_samples()))
    report = compare_results(result, result)
    assert not report.regressed
    assert len(report.comparisons) == 2 * len(HEADLINE_METRICS)
    assert all(c.verdict == "unchanged" and c.change == 0 for c in report.comparisons)


def test_slowed_run_regresses_on_every_headline_metric():
    baseline = make_result(make_run(RUN_A, steady_samples()), make_run(RUN_B, steady_samples()))
    current = make_result(make_run(RUN_A, steady_samples(throughput_scale=0.8, latency_scale=1.25)), make_run(RUN_B, steady_samples()))
    report = compare_results(baseline, current)
    assert report.regressed
    by_key = verdicts(report)
    assert all(by_key[(RUN_A, metric)] == "regressed" for metric in HEADLINE_METRICS)
    assert all(by_key[(RUN_B, metric)] == "unchanged" for metric in HEADLINE_METRICS)
    slowed = {c.metric: c for c in report.comparisons if c.run_id == RUN_A}
    assert slowed["output_tokens_per_s"].change == pytest.approx(-0.2)
    assert slowed["ttft_p50_s"].change == pytest.approx(0.25)
    assert slowed["ttft_p50_s"].noise < 0.05

    table = report.format_table()
    regressed_lines = [line for line in table.splitlines() if line.startswith("!!")]
    assert len(regressed_lines) == len(HEADLINE_METRICS)
    assert all(RUN_A in line and "regressed" in line for line in regressed_lines)
    assert any("output_tokens_per_s" in line and "-20.0%" in line for line in regressed_lines)
    assert any("ttft_p50_s" in line and "+25.0%" in line for line in regressed_lines)


def test_change_inside_noise_is_unchanged():
    # 8% slower on average, but repeats swing by ±20%: the noise explains it.
    base = [1000.0, 1200.0, 800.0, 1100.0, 900.0]
    current = [value * 0.92 for value in [1200.0, 800.0, 1000.0, 900.0, 1100.0]]
    comparison = one_metric("output_tokens_per_s", base, current)
    assert comparison.change == pytest.approx(-0.08)
    assert comparison.noise > 0.08
    assert comparison.verdict == "unchanged"


def test_change_below_threshold_is_unchanged_even_when_clearly_measured():
    base = [1000.0, 1000.1, 999.9]
    comparison = one_metric("output_tokens_per_s", base, [value * 0.97 for value in base])
    assert comparison.change == pytest.approx(-0.03)
    assert comparison.noise < 0.001
    assert comparison.verdict == "unchanged"
    assert one_metric("output_tokens_per_s", base, [value * 0.97 for value in base], threshold=0.02).verdict == "regressed"


def test_improvements_are_improved_and_not_regressions():
    baseline = make_result(make_run(RUN_A, steady_samples()))
    current = make_result(make_run(RUN_A, steady_samples(throughput_scale=1.3, latency_scale=0.7)))
    report = compare_results(baseline, current)
    assert not report.regressed
    assert all(c.verdict == "improved" for c in report.comparisons)


@pytest.mark.parametrize("metric", list(HEADLINE_METRICS))
def test_direction_follows_headline_metrics(metric):
    base = [TYPICAL[metric] * s for s in STEADY]
    up = one_metric(metric, base, [value * 1.3 for value in base]).verdict
    down = one_metric(metric, base, [value * 0.7 for value in base]).verdict
    if metric in THROUGHPUTS:
        assert (up, down) == ("improved", "regressed")
    else:
        assert (up, down) == ("regressed", "improved")


def test_direction_table_covers_both_kinds():
    assert {"output_tokens_per_s", "requests_per_s"} <= set(THROUGHPUTS)
    assert {"ttft_p50_s", "tpot_p50_s", "e2e_p50_s"} <= set(LATENCIES)


def test_missing_and_new_runs_and_metrics_are_reported_but_never_regressions():
    baseline = make_result(
        make_run(RUN_A, {"output_tokens_per_s": [1000.0, 1001.0], "ttft_p50_s": [0.05, 0.051]}),
        make_run(RUN_B, {"output_tokens_per_s": [500.0, 501.0]}),
    )
    current = make_result(
        make_run(RUN_A, {"output_tokens_per_s": [1000.0, 1001.0], "e2e_p50_s": [1.0, 1.1]}),
        make_run("synthetic/new/autodeploy", {"requests_per_s": [3.0, 3.1]}),
    )
    report = compare_results(baseline, current)
    assert not report.regressed
    assert verdicts(report) == {
        (RUN_A, "output_tokens_per_s"): "unchanged",
        (RUN_A, "ttft_p50_s"): "missing",
        (RUN_A, "e2e_p50_s"): "new",
        (RUN_B, "output_tokens_per_s"): "missing",
        ("synthetic/new/autodeploy", "requests_per_s"): "new",
    }
    missing = next(c for c in report.comparisons if c.run_id == RUN_B)
    assert (missing.baseline_mean, missing.current_mean, missing.change) == (500.5, None, None)
    new = next(c for c in report.comparisons if c.run_id == "synthetic/new/autodeploy")
    assert new.baseline_mean is None and new.current_mean == pytest.approx(3.05)


def test_only_headline_metrics_with_samples_are_compared():
    samples = {"output_tokens_per_s": [1000.0, 1001.0], "peak_memory_gb": [1.0, 9.0], "ttft_p50_s": []}
    report = compare_results(make_result(make_run(RUN_A, samples)), make_result(make_run(RUN_A, samples)))
    assert [c.metric for c in report.comparisons] == ["output_tokens_per_s"]


@pytest.mark.parametrize("base_repeats, current_repeats", [(1, 5), (5, 1), (1, 1)], ids=["baseline-once", "current-once", "both-once"])
def test_a_single_repeat_on_either_side_leaves_the_threshold_alone_to_decide(base_repeats, current_repeats):
    # A spread of ±10% would explain a 6% change, but a side measured once has no spread to judge noise by.
    spread = (1.0, 1.1, 0.9, 1.05, 0.95)
    base = [1000.0 * s for s in spread[:base_repeats]]
    current = [940.0 * s for s in spread[:current_repeats]]
    slowed = one_metric("output_tokens_per_s", base, current)
    assert slowed.noise is None and slowed.threshold_only
    assert slowed.verdict == "regressed"
    assert one_metric("output_tokens_per_s", base, [960.0 * s for s in spread[:current_repeats]]).verdict == "unchanged"
    assert not one_metric("output_tokens_per_s", [1000.0, 1000.0], [940.0, 940.0]).threshold_only


def test_table_heading_says_when_a_single_repeat_baseline_makes_it_threshold_only():
    # A baseline file recorded with --repeats 1, compared with a current result of three repeats.
    baseline = make_result(make_run(RUN_A, {"output_tokens_per_s": [1000.0], "ttft_p50_s": [0.05]}))
    current = make_result(make_run(RUN_A, {"output_tokens_per_s": [940.0, 945.0, 935.0], "ttft_p50_s": [0.05, 0.051, 0.049]}))
    heading, header, *rows, summary = compare_results(baseline, current).format_table().splitlines()
    assert heading.startswith("threshold-only comparison (no noise estimate): the baseline recorded a single repeat")
    assert "--repeats 2 or more" in heading
    assert header.split() == ["run", "metric", "baseline", "current", "change", "noise", "verdict"]
    assert len(rows) == 2 and all(line.split()[-2] == "?" for line in rows)
    assert summary.startswith("1 regressed of 2 compared")


def test_table_heading_counts_the_threshold_only_comparisons_when_some_have_repeats():
    baseline = make_result(make_run(RUN_A, {"output_tokens_per_s": [1000.0]}), make_run(RUN_B, steady_samples()))
    current = make_result(make_run(RUN_A, {"output_tokens_per_s": [1000.0, 1001.0]}), make_run(RUN_B, steady_samples()))
    heading = compare_results(baseline, current).format_table().splitlines()[0]
    assert heading.startswith(f"threshold-only comparison for 1 of {1 + len(HEADLINE_METRICS)} comparisons (no noise estimate)")


def test_table_has_no_heading_when_every_side_has_repeats():
    result = make_result(make_run(RUN_A, steady_samples()))
    assert compare_results(result, result).format_table().splitlines()[0].split()[0] == "run"


def test_zero_baseline_still_compares():
    comparison = one_metric("output_tokens_per_s", [0.0, 0.0], [100.0, 100.0])
    assert comparison.change is None and comparison.verdict == "improved"
    assert one_metric("ttft_p50_s", [0.0, 0.0], [0.1, 0.1]).verdict == "regressed"


@pytest.mark.parametrize("threshold", [0.0, -0.05, float("nan"), float("inf")])
def test_threshold_must_be_positive(threshold):
    result = make_result(make_run(RUN_A, steady_samples()))
    with pytest.raises(ConfigError, match="threshold"):
        compare_results(result, result, threshold=threshold)


def test_confidence_sigmas_must_be_non_negative():
    result = make_result(make_run(RUN_A, steady_samples()))
    with pytest.raises(ConfigError, match="confidence_sigmas"):
        compare_results(result, result, confidence_sigmas=-1.0)


def test_format_table_has_one_aligned_line_per_comparison():
    baseline = make_result(make_run(RUN_A, steady_samples()), make_run(RUN_B, {"output_tokens_per_s": [10.0, 10.1]}))
    current = make_result(make_run(RUN_A, steady_samples(throughput_scale=0.8)), make_run("synthetic/new/hf-eager", {"e2e_p50_s": [2.0]}))
    report = compare_results(baseline, current)
    lines = report.format_table().splitlines()
    header, rows, summary = lines[0], lines[1:-1], lines[-1]
    assert len(rows) == len(report.comparisons)
    for comparison, line in zip(report.comparisons, rows):
        assert comparison.run_id in line and comparison.metric in line and line.endswith(comparison.verdict)
    assert {c.verdict for c in report.comparisons} == {"regressed", "unchanged", "missing", "new"}
    verdict_column = header.index("verdict")
    assert all(line[verdict_column:].strip() in {"regressed", "unchanged", "missing", "new"} for line in rows)
    assert summary.startswith(f"{len(THROUGHPUTS)} regressed of {len(report.comparisons)} compared")


def test_docstring_example_runs():
    assert doctest.testmod(regression).failed == 0


samples_strategy = st.dictionaries(
    st.sampled_from(list(HEADLINE_METRICS)),
    st.lists(st.floats(min_value=1e-4, max_value=1e6), min_size=1, max_size=6),
)
result_strategy = st.lists(samples_strategy, min_size=1, max_size=3).map(
    lambda runs: make_result(*(make_run(f"synthetic/run{i}/autodeploy", samples) for i, samples in enumerate(runs)))
)


@given(result_strategy, st.floats(min_value=1e-3, max_value=0.5))
def test_result_never_regresses_against_itself(result, threshold):
    report = compare_results(result, result, threshold=threshold)
    assert not report.regressed
    assert all(c.verdict == "unchanged" for c in report.comparisons)


@given(result_strategy, st.floats(min_value=1.0, max_value=10.0))
def test_scaling_throughput_up_never_regresses(result, scale):
    faster = make_result(
        *(
            make_run(run.id, {m: [v * scale if HEADLINE_METRICS[m] else v for v in values] for m, values in run.samples.items()})
            for run in result.runs
        )
    )
    report = compare_results(result, faster)
    assert not report.regressed
    assert all(c.verdict in {"improved", "unchanged"} for c in report.comparisons)


# The result file is the contract between two autodeploy versions: changing its shape must be deliberate
# (bump SCHEMA_VERSION), so these pin it.
def test_result_round_trips_through_save_and_load(tmp_path):
    result = make_result(make_run(RUN_A, steady_samples()), make_run(RUN_B, {"ttft_p50_s": [0.05]}))
    result.runs[0].ratios = {"output_tokens_per_s/hf-eager": 1.4}
    result.runs[0].per_request = {"ttft_s": [0.04, 0.06]}
    result.accuracy = {"perplexity": 12.5}
    path = tmp_path / "result.json"
    result.save(path)
    assert load_result(path) == result


def test_result_json_keys_are_pinned(tmp_path):
    path = tmp_path / "result.json"
    make_result(make_run(RUN_A, steady_samples())).save(path)
    data = json.loads(path.read_text())
    assert set(data) == {"schema_version", "created", "machine", "model", "settings", "build", "runs", "accuracy"}
    assert data["schema_version"] == 1
    assert set(data["runs"][0]) == {"id", "workload", "engine", "repeats", "metrics", "samples", "ratios", "per_request"}
