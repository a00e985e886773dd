"""Regression detection for ``autodeploy bench --baseline old.json``: compare two result files metric by metric.

Runs are matched by ``RunResult.id`` and only headline metrics (``HEADLINE_METRICS``) with samples in
``RunResult.samples`` are compared. A metric regresses only when it moved in the bad direction by more
than ``threshold`` (relative) *and* by more than measurement noise can explain, so a noisy machine does
not cry wolf and a tiny but steady change does not either.

Noise is ``confidence_sigmas`` standard errors of the difference of the two means,
``sqrt(s_b²/n_b + s_c²/n_c)``, with ``s`` the sample standard deviation over repeats. A side measured
once has no spread of its own; it is assumed to spread like the other side (the same benchmark on the
same kind of machine), which keeps its ``1/n`` term. With a single repeat on both sides the noise is
unknown and the threshold alone decides; the table shows the noise as ``?`` so a reader knows.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal

from autodeploy.bench.results import HEADLINE_METRICS, BenchResult, RunResult
from autodeploy.errors import ConfigError

Verdict = Literal["regressed", "improved", "unchanged", "missing", "new"]


@dataclass
class MetricComparison:
    """One headline metric of one run, baseline against current.

    ``change`` is relative and signed, ``(current - baseline) / |baseline|``; ``noise`` is the relative
    change measurement noise alone can explain (``None`` when unknown or when one side has no data).
    ``verdict``: ``missing`` = only in the baseline, ``new`` = only in current.
    """

    run_id: str
    metric: str
    baseline_mean: float | None
    current_mean: float | None
    change: float | None
    noise: float | None
    verdict: Verdict


@dataclass
class RegressionReport:
    comparisons: list[MetricComparison]
    threshold: float

    @property
    def regressed(self) -> bool:
        return any(c.verdict == "regressed" for c in self.comparisons)

    def format_table(self) -> str:
        """Aligned diff table, one line per comparison; regressed lines start with ``!!``."""
        header = ("", "run", "metric", "baseline", "current", "change", "noise", "verdict")
        rows = [header] + [_table_row(c) for c in self.comparisons]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        numeric = {"baseline", "current", "change", "noise"}  # right-aligned so digits line up
        lines = [
            "  ".join(
                cell.rjust(width) if name in numeric else cell.ljust(width) for cell, width, name in zip(row, widths, header)
            ).rstrip()
            for row in rows
        ]
        n_regressed = sum(c.verdict == "regressed" for c in self.comparisons)
        lines.append(f"{n_regressed} regressed of {len(self.comparisons)} compared (threshold {self.threshold:.1%}, and beyond noise)")
        return "\n".join(lines)


def compare_results(
    baseline: BenchResult, current: BenchResult, threshold: float = 0.05, confidence_sigmas: float = 3.0
) -> RegressionReport:
    """Compare every headline metric of every run in ``baseline`` and ``current``.

    >>> from autodeploy.bench.results import BenchResult, RunResult
    >>> def result(tokens_per_s):
    ...     run = RunResult(id="synthetic/b1/autodeploy", workload={}, engine="autodeploy", repeats=3,
    ...                     metrics={}, samples={"output_tokens_per_s": tokens_per_s})
    ...     return BenchResult(created="", machine={}, model="tiny", settings={}, build={}, runs=[run])
    >>> report = compare_results(result([100.0, 101.0, 99.0]), result([80.0, 81.0, 79.0]))
    >>> report.regressed
    True
    >>> print(report.format_table())
        run                      metric               baseline  current  change  noise  verdict
    !!  synthetic/b1/autodeploy  output_tokens_per_s       100       80  -20.0%  ±2.4%  regressed
    1 regressed of 1 compared (threshold 5.0%, and beyond noise)
    """
    if not (math.isfinite(threshold) and threshold > 0):
        raise ConfigError(f"regression threshold must be a positive relative change such as 0.05 (5%), got {threshold!r}")
    if not (math.isfinite(confidence_sigmas) and confidence_sigmas >= 0):
        raise ConfigError(f"confidence_sigmas must be a non-negative number of standard errors such as 3, got {confidence_sigmas!r}")

    comparisons: list[MetricComparison] = []
    for base_run in baseline.runs:
        current_run = current.run(base_run.id)
        base_samples = _headline_samples(base_run)
        current_samples = _headline_samples(current_run) if current_run is not None else {}
        for metric in HEADLINE_METRICS:
            if metric in base_samples and metric in current_samples:
                comparisons.append(
                    _compare_metric(base_run.id, metric, base_samples[metric], current_samples[metric], threshold, confidence_sigmas)
                )
            elif metric in base_samples:
                comparisons.append(_one_sided(base_run.id, metric, base_samples[metric], "missing"))
            elif metric in current_samples:
                comparisons.append(_one_sided(base_run.id, metric, current_samples[metric], "new"))
    for current_run in current.runs:
        if baseline.run(current_run.id) is None:
            for metric, values in _headline_samples(current_run).items():
                comparisons.append(_one_sided(current_run.id, metric, values, "new"))
    return RegressionReport(comparisons=comparisons, threshold=threshold)


def _headline_samples(run: RunResult) -> dict[str, list[float]]:
    """Headline metrics that have at least one sample, in ``HEADLINE_METRICS`` order."""
    return {metric: run.samples[metric] for metric in HEADLINE_METRICS if run.samples.get(metric)}


def _compare_metric(
    run_id: str, metric: str, base: list[float], current: list[float], threshold: float, confidence_sigmas: float
) -> MetricComparison:
    base_mean, current_mean = statistics.fmean(base), statistics.fmean(current)
    difference = current_mean - base_mean
    absolute_noise = _absolute_noise(base, current, confidence_sigmas)
    # Decided in absolute units so a zero baseline (a broken run) still compares; relative only for display.
    beyond_threshold = abs(difference) > threshold * abs(base_mean)
    beyond_noise = absolute_noise is None or abs(difference) > absolute_noise
    if difference != 0 and beyond_threshold and beyond_noise:
        got_better = (difference > 0) == HEADLINE_METRICS[metric]
        verdict = "improved" if got_better else "regressed"
    else:
        verdict = "unchanged"
    relative = base_mean != 0
    return MetricComparison(
        run_id=run_id,
        metric=metric,
        baseline_mean=base_mean,
        current_mean=current_mean,
        change=difference / abs(base_mean) if relative else None,
        noise=absolute_noise / abs(base_mean) if relative and absolute_noise is not None else None,
        verdict=verdict,
    )


def _absolute_noise(base: list[float], current: list[float], confidence_sigmas: float) -> float | None:
    """``confidence_sigmas`` standard errors of ``mean(current) - mean(base)``; ``None`` if no side has spread."""
    base_std = statistics.stdev(base) if len(base) > 1 else None
    current_std = statistics.stdev(current) if len(current) > 1 else None
    if base_std is None and current_std is None:
        return None
    # A single repeat has no measured spread; assume it spreads like the other side (see module docstring).
    base_std = current_std if base_std is None else base_std
    current_std = base_std if current_std is None else current_std
    return confidence_sigmas * math.sqrt(base_std**2 / len(base) + current_std**2 / len(current))


def _one_sided(run_id: str, metric: str, values: list[float], verdict: Verdict) -> MetricComparison:
    mean = statistics.fmean(values)
    return MetricComparison(
        run_id=run_id,
        metric=metric,
        baseline_mean=mean if verdict == "missing" else None,
        current_mean=mean if verdict == "new" else None,
        change=None,
        noise=None,
        verdict=verdict,
    )


def _table_row(comparison: MetricComparison) -> tuple[str, ...]:
    both_sides = comparison.baseline_mean is not None and comparison.current_mean is not None
    if comparison.noise is not None:
        noise = f"±{comparison.noise:.1%}"
    else:
        noise = "?" if both_sides else "-"  # "?": compared, but noise unknown (one repeat each side) or baseline 0
    return (
        "!!" if comparison.verdict == "regressed" else "",
        comparison.run_id,
        comparison.metric,
        _format_value(comparison.baseline_mean),
        _format_value(comparison.current_mean),
        f"{comparison.change:+.1%}" if comparison.change is not None else "-",
        noise,
        comparison.verdict,
    )


def _format_value(value: float | None) -> str:
    return f"{value:.4g}" if value is not None else "-"
