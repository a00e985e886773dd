"""The human-readable benchmark table printed on stdout."""

from __future__ import annotations

from autodeploy.bench.results import HEADLINE_METRICS, BenchResult

RATIO_METRICS = ("output_tokens_per_s", "e2e_p50_s")  # the ratios worth a line: one throughput, one latency
SERVER_RATIO_METRICS = ("output_tokens_per_s", "ttft_p50_s", "tpot_p50_s", "e2e_p50_s")  # what the server adds


def _ms(distribution: dict | None, quantile: str) -> str:
    return "-" if distribution is None else f"{1000 * distribution[quantile]:.1f}"


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}G"


def _acceptance(value: float | None, none: str = "never") -> str:
    return none if value is None else f"{value:.2f}"


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _ratios(ratios: dict[str, float], metrics: tuple[str, ...] = RATIO_METRICS) -> str:
    """``output_tokens_per_s/hf-eager 0.73× (worse), e2e_p50_s/hf-eager 1.40× (worse: slower)``."""
    shown = []
    for metric in metrics:
        for name in sorted(n for n in ratios if n.split("/")[0] == metric):
            shown.append(f"{name} {ratios[name]:.2f}× ({_ratio_verdict(ratios[name], HEADLINE_METRICS[metric])})")
    return ", ".join(shown)


def _ratio_verdict(ratio: float, higher_is_better: bool) -> str:
    if f"{ratio:.2f}" == "1.00":  # what the reader sees decides, so 1.00× never reads as better or worse
        return "even"
    better = (ratio > 1) == higher_is_better
    if higher_is_better:
        return "better" if better else "worse"
    return "better: faster" if better else "worse: slower"


def format_table(result: BenchResult) -> str:
    """One line per run (latencies in ms), then ratios against baselines, build time and accuracy."""
    header = (
        "run", "out tok/s", "tot tok/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p99", "E2E p50", "E2E p99",
        "dev mem", "host RSS", "KV util", "prefix hit",
    )
    rows = [header]
    for run in result.runs:
        m = run.metrics
        rows.append((
            run.id, f"{m['output_tokens_per_s']:.1f}", f"{m['total_tokens_per_s']:.1f}", f"{m['requests_per_s']:.2f}",
            _ms(m["ttft_s"], "p50"), _ms(m["ttft_s"], "p99"), _ms(m["tpot_s"], "p50"), _ms(m["itl_s"], "p99"),
            _ms(m["e2e_s"], "p50"), _ms(m["e2e_s"], "p99"), _bytes(m.get("peak_device_memory_bytes")),
            _bytes(m.get("peak_host_rss_bytes")), _fraction(m.get("kv_pool_peak_utilization")),
            _fraction(m.get("prefix_cache_hit_rate")),
        ))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(w) if i == 0 else str(cell).rjust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    ratio_lines = [f"  {run.id}: {_ratios(run.ratios)}" for run in result.runs if run.ratios and run.engine != "server"]
    if ratio_lines:
        lines += ["", "autodeploy / baseline (same run; each ratio says whether autodeploy did better or worse):", *ratio_lines]
    server_lines = [f"  {run.id}: {_ratios(run.ratios, SERVER_RATIO_METRICS)}" for run in result.runs if run.ratios and run.engine == "server"]
    if server_lines:
        lines += ["", "over HTTP / in-process (the same engine, point by point in the same run; what the server costs):", *server_lines]
    speculating = [run for run in result.runs if run.metrics.get("speculation")]
    if speculating:
        lines += ["", "speculative decoding (tokens per verification row = accepted drafts + the model's own):"]
        for run in speculating:
            spec = run.metrics["speculation"]
            rate, length = spec["acceptance_rate"], spec["acceptance_length"]
            lines.append(f"  {run.id}: {spec['method']}, {spec['num_tokens']} tokens drafted a step; accepted "
                         f"{spec['accepted_tokens']} of {spec['drafted_tokens']} ({_fraction(rate)}), "
                         f"{'-' if length is None else f'{length:.2f}'} tokens per row over {spec['verification_rows']} rows, "
                         f"{spec['tokens_per_forward']:.2f} output tokens per engine step")
            steps = spec.get("steps")
            if steps and any(kind["steps"] for kind in steps.values()):
                lines.append("    steps of decodes alone: " + ", ".join(
                    f"{kind['steps']} {name} ({kind['mean_ms']:.2f} ms)" for name, kind in steps.items() if kind["steps"]))
            auto = spec.get("auto")
            if auto:
                lines.append(f"    auto at {auto['batch']}: drafts from a per-token acceptance of "
                             f"{_acceptance(auto['threshold_as_run'])} as steps ran ({_acceptance(auto['threshold_set_up'])} "
                             f"by the set-up's forwards); this run's: {_acceptance(spec.get('per_token_acceptance'), '-')}")
    failed = [run for run in result.runs if run.metrics.get("failed_requests")]
    if failed:
        lines += ["", "requests that failed (left out of the metrics above):"]
        lines += [f"  {run.id}: {run.metrics['failed_requests']} of {run.metrics['failed_requests'] + run.metrics['num_requests']}, "
                  f"e.g. {run.metrics['failures'][0]}" for run in failed]
    if result.build["stages"]:
        stages = ", ".join(f"{stage} {seconds:.2f}s" for stage, seconds in result.build["stages"].items())
        lines += ["", f"build {result.build['total_s']:.2f}s ({stages}) on {result.machine['device_name']} ({result.machine['device']})"]
    else:
        lines += ["", f"measured over HTTP: {result.machine['device_name']} ({result.model})"]
    if result.accuracy:
        a = result.accuracy
        line = (f"accuracy vs HF eager: top-1 agreement {100 * a['top1_agreement']:.2f}% over {a['num_tokens']} tokens, "
                f"max |Δlogit| {a['max_abs_logit_error']:.3g}, mean {a['mean_abs_logit_error']:.3g}")
        if "perplexity" in a:
            line += f"; perplexity {a['perplexity']['perplexity']:.3f} on {a['perplexity']['num_tokens']} tokens"
        lines.append(line)
    return "\n".join(lines)
