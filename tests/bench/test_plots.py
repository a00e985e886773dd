"""write_plots draws every plot the result has data for, as PNG files with fixed names, and nothing else."""

from __future__ import annotations

import builtins
import math

import pytest

from autodeploy.bench.plots import write_plots
from autodeploy.bench.results import BenchResult, RunResult
from autodeploy.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def latency(p50: float) -> dict[str, float]:
    return {"mean": p50, "p50": p50, "p90": 1.5 * p50, "p99": 2 * p50}


def run(run_id: str, workload: dict, engine: str, tokens_per_s: float, e2e: float) -> RunResult:
    ttfts = [0.01 * (i + 1) for i in range(8)]
    return RunResult(
        id=run_id,
        workload=workload,
        engine=engine,
        repeats=1,
        metrics={"output_tokens_per_s": tokens_per_s, "ttft_s": latency(0.02), "tpot_s": latency(0.005), "e2e_s": latency(e2e)},
        per_request={"ttft_s": ttfts, "e2e_s": [t + 0.5 for t in ttfts], "tpot_s": [0.005] * 8},
    )


def bench_result(runs: list[RunResult]) -> BenchResult:
    return BenchResult(created="2026-12-01T00:00:00+00:00", machine={"device": "cpu"}, model="tiny", settings={}, build={}, runs=runs)


def example_result() -> BenchResult:
    runs = []
    for engine, speed in (("autodeploy", 100.0), ("hf-eager", 40.0)):
        for batch in (1, 4, 16):
            workload = {"kind": "synthetic", "batch": batch, "input_len": 32, "output_len": 16, "seed": 0}
            runs.append(run(f"synthetic/b{batch}-in32-out16/{engine}", workload, engine, speed * batch**0.5, 0.5))
    for rate in (1.0, 2.0, 4.0):
        workload = {"kind": "poisson", "rate": rate, "num_requests": 8, "input_len": "fixed:32", "output_len": "fixed:16", "seed": 0}
        runs.append(run(f"poisson/rate{rate:g}-n8-infixed:32-outfixed:16/autodeploy", workload, "autodeploy", 50 * rate, 0.4 + rate / 10))
    return bench_result(runs)


def test_writes_each_plot_as_png(tmp_path):
    paths = write_plots(example_result(), tmp_path / "plots")

    assert [p.name for p in paths] == [
        "latency_cdf_ttft.png",
        "latency_cdf_tpot.png",
        "latency_cdf_e2e.png",
        "throughput_vs_batch.png",
        "throughput_vs_rate.png",
        "latency_vs_throughput.png",
    ]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(p.name for p in paths)
    for path in paths:
        assert path.read_bytes().startswith(PNG_MAGIC)


def test_skips_plots_without_data(tmp_path):
    # Infinite throughput (a zero-length run) and missing per-request latencies leave nothing to draw.
    lonely = run("synthetic/b1-in1-out1/autodeploy", {"kind": "synthetic", "batch": 1}, "autodeploy", math.inf, 0.1)
    lonely.per_request = {"ttft_s": [0.01], "e2e_s": [0.02], "tpot_s": []}

    paths = write_plots(bench_result([lonely]), tmp_path)

    assert [p.name for p in paths] == ["latency_cdf_ttft.png", "latency_cdf_e2e.png"]


def test_empty_result_writes_nothing(tmp_path):
    assert write_plots(bench_result([]), tmp_path / "plots") == []
    assert not (tmp_path / "plots").exists()


def test_missing_matplotlib_is_a_config_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def import_without_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", import_without_matplotlib)
    with pytest.raises(ConfigError, match="pip install matplotlib"):
        write_plots(example_result(), tmp_path)
