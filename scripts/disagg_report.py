"""Issue 46's figure from ``scripts/disagg_gpu.sh``'s two bench files: per arrival rate, the aggregated server's and the
disaggregated router's TPOT p99, ITL p99, TTFT p99 and output tok/s; then the target's point — the first rate where the
aggregated TPOT p99 passes 50 ms — with the ratios there (target: TPOT p99 ≤ 0.6×, output tok/s within 10%).

    python3 scripts/disagg_report.py OUT_DIR            # reads OUT_DIR/agg.json and OUT_DIR/disagg.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LIMIT_S = 0.050


def _points(path: Path) -> dict[float, dict]:
    runs = json.loads(path.read_text())["runs"]
    return {run["workload"]["rate"]: run["metrics"] for run in runs if run["workload"].get("kind") == "poisson"}


def main() -> None:
    folder = Path(sys.argv[1])
    aggregated, disaggregated = _points(folder / "agg.json"), _points(folder / "disagg.json")
    print(f"{'rate':>6}  {'TPOT p99 agg':>12} {'disagg':>8} {'ratio':>6}   {'ITL p99 agg':>11} {'disagg':>8}   "
          f"{'TTFT p99 agg':>12} {'disagg':>8}   {'out tok/s agg':>13} {'disagg':>8} {'ratio':>6}")
    target = None
    for rate in sorted(set(aggregated) & set(disaggregated)):
        a, d = aggregated[rate], disaggregated[rate]
        tpot_ratio = d["tpot_s"]["p99"] / a["tpot_s"]["p99"]
        rate_ratio = d["output_tokens_per_s"] / a["output_tokens_per_s"]
        print(f"{rate:6.1f}  {a['tpot_s']['p99'] * 1e3:10.1f}ms {d['tpot_s']['p99'] * 1e3:6.1f}ms {tpot_ratio:6.2f}   "
              f"{a['itl_s']['p99'] * 1e3:9.1f}ms {d['itl_s']['p99'] * 1e3:6.1f}ms   {a['ttft_s']['p99'] * 1e3:10.1f}ms "
              f"{d['ttft_s']['p99'] * 1e3:6.1f}ms   {a['output_tokens_per_s']:13.1f} {d['output_tokens_per_s']:8.1f} {rate_ratio:6.2f}"
              f"{'   failed: ' + str(a['failed_requests'] + d['failed_requests']) if a['failed_requests'] + d['failed_requests'] else ''}")
        if target is None and a["tpot_s"]["p99"] > LIMIT_S:
            target = (rate, tpot_ratio, rate_ratio)
    if target is None:
        print(f"the aggregated TPOT p99 stayed under {LIMIT_S * 1e3:.0f} ms at every rate: raise RATES")
        return
    rate, tpot_ratio, rate_ratio = target
    met = tpot_ratio <= 0.6 and abs(rate_ratio - 1) <= 0.10
    print(f"\nat {rate:g} req/s (aggregated TPOT p99 first > {LIMIT_S * 1e3:.0f} ms): TPOT p99 {tpot_ratio:.2f}× (target ≤ 0.6×), "
          f"output tok/s {rate_ratio:.2f}× (target within 10%) — {'met' if met else 'not met'}")


if __name__ == "__main__":
    main()
