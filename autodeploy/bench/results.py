"""The benchmark result format: what ``autodeploy bench --out`` writes and ``--baseline`` reads.

One JSON document (``SCHEMA_VERSION``) per invocation::

    {"schema_version": 1, "created": "2026-11-30T21:00:00+00:00",
     "machine": {"device": "cpu", "device_name": "...", "torch": "2.13.0", "cpu_count": 2},
     "model": "…", "settings": {"dtype": "float32", …},
     "build": {"total_s": 4.1, "stages": {"export": 1.4, "match": 0.9, …}},
     "runs": [RunResult, …],
     "accuracy": {…} | null}

A ``RunResult`` is one workload point through one engine: ``id`` names it stably across invocations
(``synthetic/b8-in128-out128/autodeploy``) so a baseline's runs match a new file's by id; ``metrics``
holds the summary of the last repeat's requests (latency distributions as ``{mean, p50, p90, p99}``);
``samples`` holds, per headline metric, one value per repeat — the spread regression detection needs;
``ratios`` compares autodeploy with each baseline engine measured in the same invocation
(``{"output_tokens_per_s/hf-eager": 1.4}``: autodeploy's value over the baseline's), and a ``server``
run (the same requests over HTTP) with the in-process one (``{"ttft_p50_s/autodeploy": 1.2}``: the
server's value over in-process); ``per_request`` keeps the last repeat's per-request latencies for the CDF
plots. ``metrics`` also counts ``failed_requests`` (over HTTP: errors, timeouts, short answers; left out
of the latencies and throughputs) and lists up to five distinct ``failures``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autodeploy.errors import ConfigError

SCHEMA_VERSION = 1

# Headline metrics: compared against baselines and checked for regressions. True = higher is better.
HEADLINE_METRICS: dict[str, bool] = {
    "output_tokens_per_s": True,
    "total_tokens_per_s": True,
    "requests_per_s": True,
    "ttft_p50_s": False,
    "ttft_p99_s": False,
    "tpot_p50_s": False,
    "itl_p99_s": False,
    "e2e_p50_s": False,
}

LATENCY_METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")  # each a {mean, p50, p90, p99} distribution


@dataclass
class RunResult:
    id: str
    workload: dict[str, Any]
    engine: str  # "autodeploy" | "hf-eager" | "hf-compile" | "server" (over HTTP)
    repeats: int
    metrics: dict[str, Any]
    samples: dict[str, list[float]] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    per_request: dict[str, list[float]] = field(default_factory=dict)  # last repeat: ttft_s, tpot_s, e2e_s per request (CDF plots)


@dataclass
class BenchResult:
    created: str
    machine: dict[str, Any]
    model: str
    settings: dict[str, Any]
    build: dict[str, Any]
    runs: list[RunResult] = field(default_factory=list)
    accuracy: dict[str, Any] | None = None
    schema_version: int = SCHEMA_VERSION

    def run(self, run_id: str) -> RunResult | None:
        return next((r for r in self.runs if r.id == run_id), None)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


def load_result(path: str | Path) -> BenchResult:
    """Read a result file; ``ConfigError`` if it is missing, not JSON, or another schema version."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"benchmark result {path} does not exist; pass a file written by autodeploy bench --out")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"benchmark result {path} is not JSON: {error}") from error
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        version = data.get("schema_version") if isinstance(data, dict) else None
        raise ConfigError(f"benchmark result {path} has schema version {version!r}; this autodeploy reads version {SCHEMA_VERSION}")
    try:
        runs = [RunResult(**run) for run in data.pop("runs")]
        return BenchResult(**data, runs=runs)
    except TypeError as error:
        raise ConfigError(f"benchmark result {path} does not follow schema version {SCHEMA_VERSION}: {error}") from error
