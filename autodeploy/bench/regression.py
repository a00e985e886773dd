"""Regression detection for ``autodeploy bench --baseline old.json``: compare two result files metric by metric.

Runs are matched by ``RunResult.id`` and only headline metrics (``HEADLINE_METRICS``) with samples in
``RunResult.samples`` are compared. A metric regresses only when it moved in the bad direction by more
than ``threshold`` (relative) *and* by more than measurement noise can explain, so a noisy machine does
not cry wolf and a tiny but steady change does not either.

Noise is ``confidence_sigmas`` standard errors of the difference of the two means,
``sqrt(s_b²/n_b + s_c²/n_c)``, with ``s`` the sample standard deviation over repeats. It needs at least
two repeats on each side: a side measured once has no spread, and borrowing the other side's would
trust a quiet machine's spread for a busy one. Then the threshold alone decides; the table says so in
its heading and shows the noise as ``?``.
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
    ``*_repeats`` count the samples each side's mean comes from (0 for a side without the metric).
    ``verdict``: ``missing`` = only in the baseline, ``new`` = only in current.
    """

    run_id: str
    metric: str
    baseline_mean: float | None
    current_mean: float | None
    baseline_repeats: int
    current_repeats: int
    change: float | None
    noise: float | None
    verdict: Verdict

    @property
    def threshold_only(self) -> bool:
        """Compared on both sides, but a side with a single repeat left no noise estimate."""
        return self.baseline_repeats > 0 and self.current_repeats > 0 and min(self.baseline_repeats, self.current_repeats) < 2


@dataclass
class RegressionReport:
    comparisons: list[MetricComparison]
    threshold: float

    @property
    def regressed(self) -> bool:
        return any(c.verdict == "regressed" for c in self.comparisons)

    def format_table(self) -> str:
        """Aligned diff table, one line per comparison; regressed lines start with ``!!``. A heading
        line first when some comparisons had too few repeats for a noise estimate."""
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
        heading = self._threshold_only_heading()
        noise_rule = "and beyond noise where repeats allow" if heading else "and beyond noise"
        lines.append(f"{n_regressed} regressed of {len(self.comparisons)} compared (threshold {self.threshold:.1%}, {noise_rule})")
        return "\n".join([heading, *lines] if heading else lines)

    def _threshold_only_heading(self) -> str | None:
        threshold_only = [c for c in self.comparisons if c.threshold_only]
        if not threshold_only:
            return None
        single_baseline = any(c.baseline_repeats < 2 for c in threshold_only)
        single_current = any(c.current_repeats < 2 for c in threshold_only)
        sides = {(True, False): "the baseline", (False, True): "the current result", (True, True): "both results"}
        compared = sum(c.baseline_repeats > 0 and c.current_repeats > 0 for c in self.comparisons)
        scope = "" if len(threshold_only) == compared else f" for {len(threshold_only)} of {compared} comparisons"
        return (
            f"threshold-only comparison{scope} (no noise estimate): {sides[single_baseline, single_current]} "
            "recorded a single repeat; record results with --repeats 2 or more"
        )


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
        baseline_repeats=len(base),
        current_repeats=len(current),
        change=difference / abs(base_mean) if relative else None,
        noise=absolute_noise / abs(base_mean) if relative and absolute_noise is not None else None,
        verdict=verdict,
    )


def _absolute_noise(base: list[float], current: list[float], confidence_sigmas: float) -> float | None:
    """``confidence_sigmas`` standard errors of ``mean(current) - mean(base)``; ``None`` unless both sides have spread."""
    if len(base) < 2 or len(current) < 2:
        return None
    return confidence_sigmas * math.sqrt(statistics.variance(base) / len(base) + statistics.variance(current) / len(current))


def _one_sided(run_id: str, metric: str, values: list[float], verdict: Verdict) -> MetricComparison:
    mean = statistics.fmean(values)
    return MetricComparison(
        run_id=run_id,
        metric=metric,
        baseline_mean=mean if verdict == "missing" else None,
        current_mean=mean if verdict == "new" else None,
        baseline_repeats=len(values) if verdict == "missing" else 0,
        current_repeats=len(values) if verdict == "new" else 0,
        change=None,
        noise=None,
        verdict=verdict,
    )


def _table_row(comparison: MetricComparison) -> tuple[str, ...]:
    both_sides = comparison.baseline_mean is not None and comparison.current_mean is not None
    if comparison.noise is not None:
        noise = f"±{comparison.noise:.1%}"
    else:
        noise = "?" if both_sides else "-"  # "?": compared, but noise unknown (a side with one repeat) or baseline 0
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
