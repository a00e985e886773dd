"""One ``autodeploy bench`` invocation: deploy, build every workload, measure, compare, collect.

Every workload is built (and so validated) before the first measurement, so a bad rate, a length
beyond ``max_seq_len`` or a broken dataset fails in seconds, not after an hour of sweeps. Each point
runs ``repeats`` times after one warm-up, the repeats taking turns across points; the summary comes
from the last repeat, the spread from all.
Baseline engines (``hf-eager``, ``hf-compile``) run the synthetic points in the same process; the
ratios are autodeploy's value over theirs.

    config = BenchmarkConfig(model=None, workloads=["synthetic"], batch=[1, 8], input_len=[32], output_len=[32])
    result = run_benchmark(config)
    print(format_table(result))
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import platform
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from autodeploy.bench.metrics import RequestTiming, headline_values, summarize
from autodeploy.bench.results import BenchResult, RunResult
from autodeploy.bench.runner import RunMeasurement, peak_host_rss_bytes, run_workload
from autodeploy.bench.workloads import (
    Workload,
    concurrency_workload,
    poisson_workload,
    realistic_requests,
    synthetic_workload,
)
from autodeploy.config import DeploySettings, load_yaml, parse_set_arguments, site_config_files
from autodeploy.errors import ConfigError

logger = logging.getLogger(__name__)

WORKLOADS = ("synthetic", "poisson", "concurrency", "accuracy")
BASELINE_ENGINES = ("hf-eager", "hf-compile")


@dataclass
class BenchmarkConfig:
    model: str | None = None
    config_files: list[str] = field(default_factory=list)
    set_arguments: list[str] = field(default_factory=list)
    workloads: list[str] = field(default_factory=lambda: ["synthetic"])
    batch: list[int] = field(default_factory=lambda: [1, 8])
    input_len: list[int] = field(default_factory=lambda: [128])
    output_len: list[int] = field(default_factory=lambda: [128])
    rates: list[float] = field(default_factory=lambda: [1.0])
    concurrency: list[int] = field(default_factory=lambda: [8])
    num_requests: int = 32
    input_dist: str = "uniform:32:256"
    output_dist: str = "uniform:16:128"
    dataset: str | None = None
    perplexity_text: str | None = None
    repeats: int = 3
    seed: int = 0
    compare: list[str] = field(default_factory=list)
    progress: bool = True

    def validate(self) -> None:
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown or not self.workloads:
            raise ConfigError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
        bad_engines = [e for e in self.compare if e not in BASELINE_ENGINES]
        if bad_engines:
            raise ConfigError(f"unknown baseline(s) {bad_engines} for --compare; choose from {', '.join(BASELINE_ENGINES)}")
        if self.repeats < 1:
            raise ConfigError(f"--repeats must be ≥ 1, got {self.repeats}")
        if any(rate <= 0 for rate in self.rates):
            raise ConfigError(f"arrival rates must be > 0 requests/s, got {self.rates}")
        if self.perplexity_text is not None and not Path(self.perplexity_text).is_file():
            raise ConfigError(f"perplexity text file {self.perplexity_text} does not exist")


def build_workloads(config: BenchmarkConfig, vocab_size: int, max_seq_len: int, tokenizer) -> list[Workload]:
    workloads = []
    if "synthetic" in config.workloads:
        for batch in config.batch:
            for input_len in config.input_len:
                for output_len in config.output_len:
                    workloads.append(synthetic_workload(batch, input_len, output_len, vocab_size, max_seq_len, config.seed))
    if {"poisson", "concurrency"} & set(config.workloads):
        requests = realistic_requests(
            config.num_requests, config.input_dist, config.output_dist, vocab_size, max_seq_len, config.seed, config.dataset, tokenizer
        )
        description = {
            "num_requests": config.num_requests,
            "input_len": f"dataset:{Path(config.dataset).name}" if config.dataset else config.input_dist,
            "output_len": config.output_dist,
            "seed": config.seed,
        }
        if "poisson" in config.workloads:
            workloads += [poisson_workload(requests, rate, config.seed, description) for rate in config.rates]
        if "concurrency" in config.workloads:
            workloads += [concurrency_workload(requests, c, description) for c in config.concurrency]
    return workloads


def _run_result(workload: Workload, engine: str, measurements: list[RunMeasurement]) -> RunResult:
    last = measurements[-1]
    metrics = summarize(last.timings)
    metrics.update(
        peak_device_memory_bytes=last.peak_device_memory_bytes,
        peak_host_rss_bytes=last.peak_host_rss_bytes,
        kv_pool_peak_utilization=last.kv_pool_peak_utilization,
        prefix_cache_hit_rate=last.prefix_cache_hit_rate,
    )
    samples: dict[str, list[float]] = defaultdict(list)
    for measurement in measurements:
        for name, value in headline_values(summarize(measurement.timings)).items():
            samples[name].append(value)
    per_request = {
        "ttft_s": [t.ttft for t in last.timings],
        "e2e_s": [t.e2e for t in last.timings],
        "tpot_s": [t.tpot for t in last.timings if t.tpot is not None],
    }
    return RunResult(f"{workload.id}/{engine}", {"kind": workload.kind, **workload.description}, engine, len(measurements), metrics, dict(samples), {}, per_request)


def _hf_measurements(config: BenchmarkConfig, workload: Workload, engine: str, model, device: torch.device) -> list[RunMeasurement]:
    from autodeploy.bench.hf_baselines import hf_generate_timing

    prompts = [r.prompt_token_ids for r in workload.requests]
    measurements = []
    for _ in range(config.repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timing = hf_generate_timing(model, prompts, workload.description["output_len"], engine)
        timings = [RequestTiming(timing.start, list(timing.token_times), timing.input_len) for _ in prompts]
        measurements.append(
            RunMeasurement(
                timings,
                torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                peak_host_rss_bytes(),
                kv_pool_peak_utilization=None,
                prefix_cache_hit_rate=None,
            )
        )
    return measurements


def _ratios(result: BenchResult) -> None:
    for run in result.runs:
        if run.engine != "autodeploy":
            continue
        for engine in BASELINE_ENGINES:
            other = result.run(run.id.rsplit("/", 1)[0] + f"/{engine}")
            if other is None:
                continue
            ours, theirs = headline_values(run.metrics), headline_values(other.metrics)
            for name, value in ours.items():
                if theirs.get(name):
                    run.ratios[f"{name}/{engine}"] = value / theirs[name]


def _machine(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {"device": device.type, "device_name": name, "torch": torch.__version__, "cpu_count": os.cpu_count(), "python": platform.python_version()}


def _sized_for_workloads(config: BenchmarkConfig) -> list[str]:
    """``config.set_arguments``, plus ``max_batch_size`` large enough for the largest batch or concurrency
    point unless the user's files or ``--set`` name it: otherwise a 256-request point would be served 32 at a
    time (the default) and compared with baselines that run all 256 at once."""
    files = [*site_config_files(), *config.config_files]
    layers = [*(load_yaml(path) for path in files), parse_set_arguments(config.set_arguments)]
    named = any("max_batch_size" in layer for layer in layers)
    points = [*(config.batch if "synthetic" in config.workloads else ()),
              *(config.concurrency if "concurrency" in config.workloads else ())]
    if named or not points or max(points) <= DeploySettings.max_batch_size:
        return list(config.set_arguments)
    return [*config.set_arguments, f"max_batch_size={max(points)}"]


def run_benchmark(config: BenchmarkConfig) -> BenchResult:
    from autodeploy import autodeploy

    config.validate()
    llm = autodeploy(config.model, config=config.config_files, set_arguments=_sized_for_workloads(config))
    settings = llm.settings
    if "accuracy" in config.workloads and settings.weights == "random":
        raise ConfigError("the accuracy workload compares with the checkpoint's own HF model; it needs weights=checkpoint, not random")
    workloads = build_workloads(config, llm.vocab_size, settings.max_seq_len, llm.tokenizer)
    stages: dict[str, float] = defaultdict(float)
    for record in llm.records:
        stages[record.stage] += record.seconds
    result = BenchResult(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=_machine(llm.engine.device),
        model=str(settings.model or Path(llm.model_directory).name),
        settings={"device": str(settings.device), "dtype": str(settings.dtype), "weights": settings.weights,
                  "max_batch_size": settings.max_batch_size, "block_size": settings.kv_cache.block_size,
                  "kv_blocks": llm.engine.pool.num_blocks, "max_num_tokens": settings.scheduler.max_num_tokens},
        build={"total_s": sum(stages.values()), "stages": dict(stages)},
    )
    if workloads:
        warm_up = synthetic_workload(2, 8, 4, llm.vocab_size, settings.max_seq_len, seed=config.seed + 1)
        run_workload(llm, warm_up, progress=False)
    # Repeats go round-robin over the points, so each point's spread includes the machine's drift over
    # the whole invocation, not only back-to-back jitter.
    measurements: dict[str, list[RunMeasurement]] = defaultdict(list)
    for _ in range(config.repeats):
        for workload in workloads:
            measurements[workload.id].append(run_workload(llm, workload, progress=config.progress))
    result.runs += [_run_result(workload, "autodeploy", measurements[workload.id]) for workload in workloads]
    synthetic = [w for w in workloads if w.kind == "synthetic"]
    if config.compare and len(synthetic) < len(workloads):
        logger.warning("baselines run the synthetic workloads only: HF generate() has no in-flight batching for arrival streams")
    device = llm.engine.device
    if config.compare:
        llm.free_kv_cache()  # the pool takes most of a GPU; the baselines need room for their own caches
    for engine in config.compare:
        from autodeploy.bench.hf_baselines import hf_generate_timing, load_hf_model

        model = load_hf_model(llm.model_directory, _torch_dtype(settings.dtype), device)
        # Untimed, as the engine's warm-up above: the first generate() pays one-off CUDA and cuBLAS setup.
        hf_generate_timing(model, [[1] * 8], output_len=4, mode="hf-eager")
        for workload in synthetic:
            result.runs.append(_run_result(workload, engine, _hf_measurements(config, workload, engine, model, device)))
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _ratios(result)
    if "accuracy" in config.workloads:
        result.accuracy = _accuracy(config, llm)
    return result


def _accuracy(config: BenchmarkConfig, llm) -> dict:
    from autodeploy.bench.accuracy import compare_with_hf, fixed_prompts, load_reference_model, perplexity_of_file

    reference = load_reference_model(llm)
    report = compare_with_hf(llm, reference, fixed_prompts(llm.vocab_size, llm.tokenizer, seed=config.seed)).to_dict()
    if config.perplexity_text is not None:
        ppl = perplexity_of_file(llm, config.perplexity_text)
        report["perplexity"] = {"file": str(config.perplexity_text), "perplexity": ppl.perplexity, "num_tokens": ppl.num_tokens}
    return report


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, str(name))
