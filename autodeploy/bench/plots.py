"""PNG plots of a benchmark result (``autodeploy bench --plot DIR``).

- ``latency_cdf_{ttft,tpot,e2e}.png``: each run's per-request latency distribution, as an empirical CDF.
- ``throughput_vs_{batch,concurrency,rate}.png``: output tokens/s against the swept workload parameter,
  one line per engine.
- ``latency_vs_throughput.png``: median (solid) and p99 (dashed) end-to-end latency against output
  tokens/s, one series per engine and workload kind: where an engine trades latency for throughput.

```python
paths = write_plots(load_result("bench.json"), "plots/")
```
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from autodeploy.bench.results import BenchResult, RunResult
from autodeploy.errors import ConfigError

LATENCY_CDFS = {"ttft_s": ("ttft", "time to first token (ms)"), "tpot_s": ("tpot", "time per output token (ms)"), "e2e_s": ("e2e", "end-to-end latency (ms)")}
SWEEP_AXES = {  # workload kind → (swept workload key, file suffix, axis label)
    "synthetic": ("batch", "batch", "batch size (closed batch)"),
    "concurrency": ("max_concurrency", "concurrency", "max concurrent requests"),
    "poisson": ("rate", "rate", "request rate (req/s)"),
}
# Colours repeat after ten runs; the line style still tells the engines apart.
_ENGINE_LINESTYLES = {"autodeploy": "-", "hf-eager": "--", "hf-compile": ":", "server": "-."}
_NOT_A_SERIES_KEY = {"kind", "seed"}  # workload keys that never tell two lines apart


def write_plots(result: BenchResult, directory: str | Path) -> list[Path]:
    """Write every plot the result has data for into ``directory``; return the files, in writing order.

    >>> write_plots(load_result("bench.json"), "plots")  # doctest: +SKIP
    [PosixPath('plots/latency_cdf_ttft.png'), ..., PosixPath('plots/latency_vs_throughput.png')]
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ConfigError("plots need matplotlib: pip install matplotlib (or the bench extra: pip install 'autodeploy[bench]')") from error

    directory = Path(directory)
    written: list[Path] = []

    def new_axes(title: str, xlabel: str, ylabel: str):
        # A Figure on its own Agg canvas, not pyplot: no global backend switch, nothing left open.
        figure = Figure(figsize=(7, 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        axes.set(title=f"{result.model}: {title}", xlabel=xlabel, ylabel=ylabel)
        axes.grid(alpha=0.3)
        return figure, axes

    def save(figure, axes, name: str) -> None:
        if len(axes.get_lines()) > 6:  # a long legend would cover the lines: put it beside the axes
            figure.set_size_inches(11, 4.5)
            figure.legend(fontsize="small", loc="outside right upper")
        else:
            axes.legend(fontsize="small")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        figure.savefig(path, dpi=120)
        written.append(path)

    for metric, (short, label) in LATENCY_CDFS.items():
        runs = [run for run in result.runs if _finite(run.per_request.get(metric, []))]
        if not runs:
            continue
        figure, axes = new_axes(f"{short.upper()} CDF", label, "fraction of requests")
        for run in runs:
            values = sorted(1000 * v for v in _finite(run.per_request[metric]))
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            axes.step(values, fractions, where="post", linestyle=_ENGINE_LINESTYLES.get(run.engine, "-"), label=run.id)
        axes.set_ylim(0, 1.02)
        save(figure, axes, f"latency_cdf_{short}.png")

    for kind, (key, suffix, label) in SWEEP_AXES.items():
        series = _series([run for run in result.runs if run.workload.get("kind") == kind and key in run.workload], key)
        if not series:
            continue
        figure, axes = new_axes(f"throughput vs {suffix}", label, "output tokens/s")
        xs = []
        for name, runs in series.items():
            points = sorted((run.workload[key], run.metrics["output_tokens_per_s"]) for run in runs)
            axes.plot(*zip(*points), marker="o", label=name)
            xs += [x for x, _ in points]
        if key != "rate" and min(xs) > 0 and max(xs) / min(xs) >= 8:
            axes.set_xscale("log", base=2)  # batch and concurrency sweeps double
        save(figure, axes, f"throughput_vs_{suffix}.png")

    by_engine_and_kind: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for run in result.runs:
        e2e = run.metrics.get("e2e_s")
        if _has_throughput(run) and e2e:
            by_engine_and_kind[f"{run.engine} ({run.workload.get('kind', '?')})"].append((run.metrics["output_tokens_per_s"], e2e["p50"], e2e["p99"]))
    if by_engine_and_kind:
        figure, axes = new_axes("latency vs throughput", "output tokens/s", "end-to-end latency (s)")
        for name, points in sorted(by_engine_and_kind.items()):
            throughput, p50, p99 = zip(*sorted(points))
            (line,) = axes.plot(throughput, p50, marker="o", label=f"{name} p50")
            axes.plot(throughput, p99, marker="x", linestyle="--", color=line.get_color(), label=f"{name} p99")
        save(figure, axes, "latency_vs_throughput.png")
    return written


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _has_throughput(run: RunResult) -> bool:
    value = run.metrics.get("output_tokens_per_s")
    return value is not None and math.isfinite(value)


def _series(runs: list[RunResult], swept_key: str) -> dict[str, list[RunResult]]:
    """Group a sweep's runs into lines: one per engine, split further by whatever else differs between runs.

    Two synthetic sweeps with different input lengths must not join into one zigzag line.
    """
    runs = [run for run in runs if _has_throughput(run)]

    def fixed(run: RunResult) -> dict[str, Any]:
        return {k: v for k, v in run.workload.items() if k not in _NOT_A_SERIES_KEY and k != swept_key}

    varying = sorted({k for run in runs for k, v in fixed(run).items() if any(fixed(other).get(k) != v for other in runs)})
    series: dict[str, list[RunResult]] = defaultdict(list)
    for run in sorted(runs, key=lambda run: run.engine != "autodeploy"):  # autodeploy's lines come first
        details = ", ".join(f"{k}={_short(run.workload.get(k))}" for k in varying)
        series[f"{run.engine} ({details})" if details else run.engine].append(run)
    return series


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
