"""One ``autodeploy bench`` invocation: deploy, build every workload, measure, compare, collect.

Every workload is built (and so validated) before the first measurement, so a bad rate, a length
beyond ``max_seq_len`` or a broken dataset fails in seconds, not after an hour of sweeps. Each point
runs ``repeats`` times after one warm-up, the repeats taking turns across points; the summary comes
from the last repeat, the spread from all.
Baseline engines (``hf-eager``, ``hf-compile``) run the synthetic points in the same process; the
ratios are autodeploy's value over theirs.

``--compare server`` measures every point a second time through the OpenAI server (``autodeploy serve``'s
app over the same deployed engine, under uvicorn in a thread of this process) from a client in a separate
process (``http_runner``; its own interpreter lock, as a real client's); each repeat runs a point in-process
and then over HTTP, back to back, with the prefix cache emptied before each, and the server runs carry
their value over the in-process one. ``config.url`` measures a server that is already running instead, and
builds nothing here: the model (default: the demo model) gives only the vocabulary of the random prompts.

    config = BenchmarkConfig(model=None, workloads=["synthetic"], batch=[1, 8], input_len=[32], output_len=[32])
    result = run_benchmark(config)
    print(format_table(result))
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import multiprocessing
import os
import platform
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from autodeploy.bench import replay  # noqa: F401  (registers the benchmark-only "replay" drafter)
from autodeploy.bench.metrics import RequestTiming, headline_values, summarize
from autodeploy.bench.results import BenchResult, RunResult
from autodeploy.bench.runner import RunMeasurement, peak_host_rss_bytes, run_workload
from autodeploy.bench.workloads import (
    BenchRequest,
    Workload,
    concurrency_workload,
    poisson_workload,
    realistic_requests,
    synthetic_workload,
    with_images,
)
from autodeploy.config import DeploySettings, load_yaml, parse_set_arguments, site_config_files
from autodeploy.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from autodeploy.bench.http_runner import HttpMeasurement

logger = logging.getLogger(__name__)

WORKLOADS = ("synthetic", "poisson", "concurrency", "accuracy")
BASELINE_ENGINES = ("hf-eager", "hf-compile")
SERVER = "server"  # the engine name of runs measured over HTTP, and the --compare choice that adds them
# With speculative decoding on, every point is measured first on the same engine with it off: this engine name.
NO_SPECULATION = "no-speculation"


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
    url: str | None = None  # a running OpenAI-compatible server to measure instead of an engine built here
    served_model_name: str | None = None  # None: the one model the server lists
    api_key: str | None = None
    request_timeout: float = 120.0  # seconds an HTTP request may wait for its next byte
    server_stream_interval: int = 1  # --compare server: the server's stream interval (tokens a streamed event)
    # A vision-language model's requests: this many images of image_size × image_size random pixels each (JPEG),
    # every request its own, or with same_image one image for all (the encoder cache's best case)
    images_per_request: int = 0
    image_size: int = 336
    same_image: bool = False

    def validate(self) -> None:
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown or not self.workloads:
            raise ConfigError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
        bad_engines = [e for e in self.compare if e not in (*BASELINE_ENGINES, SERVER)]
        if bad_engines:
            raise ConfigError(f"unknown baseline(s) {bad_engines} for --compare; choose from {', '.join((*BASELINE_ENGINES, SERVER))}")
        if self.url is not None and self.compare:
            raise ConfigError(
                "--compare runs other engines beside one built here, and --url builds none (HF baselines here would "
                "compare this machine with the server's); for both in one run on one machine: autodeploy bench MODEL "
                f"--compare {','.join(['server', *(e for e in self.compare if e != SERVER)])}"
            )
        if self.url is not None and "accuracy" in self.workloads:
            raise ConfigError("the accuracy workload compares logits with HF in this process, and a server does not return "
                              "logits; drop accuracy from --workload, or run it without --url")
        from autodeploy.frontend.async_llm import check_stream_interval

        try:
            check_stream_interval(self.server_stream_interval)
        except InvalidRequestError as error:
            raise ConfigError(f"--server-stream-interval: {error}") from None
        if self.server_stream_interval != 1 and SERVER not in self.compare:
            raise ConfigError("--server-stream-interval sets the server that --compare server starts; add --compare server "
                              "(a server at --url has its own, autodeploy serve --stream-interval)")
        if not self.request_timeout > 0:
            raise ConfigError(f"--request-timeout must be > 0 seconds, got {self.request_timeout}")
        if self.repeats < 1:
            raise ConfigError(f"--repeats must be ≥ 1, got {self.repeats}")
        if self.images_per_request < 0 or self.image_size < 1 or (self.same_image and not self.images_per_request):
            raise ConfigError(f"--images-per-request must be ≥ 0 and --image-size ≥ 1 (--same-image needs images), got "
                              f"{self.images_per_request}, {self.image_size} and same_image={self.same_image}")
        if self.images_per_request and (self.url is not None or SERVER in self.compare or "accuracy" in self.workloads):
            raise ConfigError("--images-per-request measures the engine built here (no --url, --compare server or accuracy)")
        if any(rate <= 0 for rate in self.rates):
            raise ConfigError(f"arrival rates must be > 0 requests/s, got {self.rates}")
        if self.perplexity_text is not None and not Path(self.perplexity_text).is_file():
            raise ConfigError(f"perplexity text file {self.perplexity_text} does not exist")
        if self.url is not None or SERVER in self.compare:
            _check_http_packages(with_server=self.url is None)


def _check_http_packages(with_server: bool) -> None:
    """Measuring over HTTP needs httpx; serving here (``--compare server``) the serve extra as well."""
    import importlib.util

    needed = {"httpx": "bench", **({"fastapi": "serve", "uvicorn": "serve"} if with_server else {})}
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        extras = ",".join(sorted({needed[name] for name in missing}))
        raise ConfigError(f"measuring over HTTP needs {', '.join(missing)}: pip install 'autodeploy[{extras}]'")


def build_workloads(config: BenchmarkConfig, vocab_size: int, max_seq_len: int, tokenizer, vision=None) -> list[Workload]:
    """Every workload the config names; with ``images_per_request``, their requests carry images (``vision``: the
    engine's ``VisionEncoder``, for the image token and the tokens an image takes)."""
    workloads = _text_workloads(config, vocab_size, max_seq_len, tokenizer)
    if vision is not None:  # a random prompt's image placeholder would be an image without its pixels
        for workload in workloads:
            for request in workload.requests:
                request.prompt_token_ids = [t if t != vision.image_token_id else (t + 1) % vocab_size for t in request.prompt_token_ids]
    if not config.images_per_request:
        return workloads
    if vision is None:
        raise ConfigError(f"--images-per-request: {config.model} takes no images (it has no vision tower)")
    return [with_images(workload, config.images_per_request, config.image_size, vision.image_token_id, vision.tokens_per_image,
                        max_seq_len, config.same_image, config.seed) for workload in workloads]


def _text_workloads(config: BenchmarkConfig, vocab_size: int, max_seq_len: int, tokenizer) -> list[Workload]:
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
        speculation=last.speculation,
        image_wait_s=last.image_wait_s,
        images_encoded=last.images_encoded,
        encoder_cache_hits=last.encoder_cache_hits,
        failed_requests=len(last.failures),
        failures=sorted(set(last.failures))[:5],  # the distinct reasons, enough to see what went wrong
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


def _hf_measurements(config: BenchmarkConfig, workload: Workload, engine: str, model, device: torch.device,
                     vision=None) -> list[RunMeasurement]:
    from autodeploy.bench.hf_baselines import hf_generate_timing

    prompts = [r.prompt_token_ids for r in workload.requests]
    pixel_values = None
    if vision is not None and workload.requests[0].images:  # HF takes the placeholders expanded and the pixels (untimed)
        width = vision.tokens_per_image
        prompts = [[t for token in prompt for t in ([token] * width if token == vision.image_token_id else [token])] for prompt in prompts]
        prepared = [image.pixel_values for r in workload.requests for image in vision.prepare(r.images)]
        pixel_values = torch.stack(prepared).to(device, next(model.parameters()).dtype)
    measurements = []
    for _ in range(config.repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timing = hf_generate_timing(model, prompts, workload.description["output_len"], engine, pixel_values=pixel_values)
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
    """autodeploy's runs over each baseline's; the server's runs over the in-process ones (its overhead)."""
    pairs = [(engine, "autodeploy") for engine in (*BASELINE_ENGINES, NO_SPECULATION)] + [("autodeploy", SERVER)]
    for run in result.runs:
        for other_engine, engine in pairs:
            if run.engine != engine:
                continue
            other = result.run(run.id.rsplit("/", 1)[0] + f"/{other_engine}")
            if other is None:
                continue
            ours, theirs = headline_values(run.metrics), headline_values(other.metrics)
            for name, value in ours.items():
                if theirs.get(name):
                    run.ratios[f"{name}/{other_engine}"] = value / theirs[name]


def _speculation_warm_up(workload: Workload) -> Workload:
    """A short run of ``workload``'s own first requests (twice its concurrency, 32 tokens out at most), all at
    once. A verification step the captured graphs do not hold (some sequences drafting, others not) runs eagerly,
    and the first launch of a Triton kernel's variant for new sizes compiles; on an H100, n-gram drafts at 8
    concurrent requests showed one stall of ~0.5 s (TTFT p99 495 ms against 24 without speculation), which a run
    of 32 requests would otherwise count as speculation's steady cost."""
    width = workload.max_concurrency or min(len(workload.requests), 32)  # a batch, or a Poisson burst's first 32
    requests = [BenchRequest(r.prompt_token_ids, min(r.output_len, 32)) for r in workload.requests[: 2 * width]]
    return Workload(workload.kind, requests, dict(workload.description), workload.max_concurrency)


def _without_speculation(llm, measure: Callable[[], RunMeasurement]) -> RunMeasurement:
    """``measure()`` with the engine's speculation off (its drafter idle, the overlapped loop free to run ahead)."""
    speculator, llm.engine.speculator = llm.engine.speculator, None
    try:
        return measure()
    finally:
        llm.engine.speculator = speculator


def _remember(llm, plain: RunMeasurement) -> None:
    """Hand a drafter that replays recorded output (``bench/replay.py``) what the run without speculation produced."""
    remember = getattr(llm.engine.speculator.drafter, "remember", None)
    if remember is not None:
        remember(plain.continuations)


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
    if config.url is not None:
        return _run_against_url(config)
    llm = autodeploy(config.model, config=config.config_files, set_arguments=_sized_for_workloads(config))
    settings = llm.settings
    if "accuracy" in config.workloads and settings.weights == "random":
        raise ConfigError("the accuracy workload compares with the checkpoint's own HF model; it needs weights=checkpoint, not random")
    workloads = build_workloads(config, llm.vocab_size, settings.max_seq_len, llm.tokenizer, llm.engine.vision)
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
    if SERVER in config.compare:
        result.settings["server_stream_interval"] = config.server_stream_interval
    warm_up = synthetic_workload(2, 8, 4, llm.vocab_size, settings.max_seq_len, seed=config.seed + 1)
    speculating = llm.engine.speculator is not None
    if workloads:
        if speculating:  # verification steps have shapes of their own to warm up
            _remember(llm, _without_speculation(llm, lambda: run_workload(llm, warm_up, progress=False)))
        run_workload(llm, warm_up, progress=False)
        if speculating:
            for workload in workloads:
                run_workload(llm, _speculation_warm_up(workload), progress=False)
    # Repeats go round-robin over the points, so each point's spread includes the machine's drift over
    # the whole invocation, not only back-to-back jitter.
    measurements: dict[str, list[RunMeasurement]] = defaultdict(list)
    served: dict[str, list[RunMeasurement]] = defaultdict(list)
    unspeculated: dict[str, list[RunMeasurement]] = defaultdict(list)
    server = _served(llm, workloads, warm_up, config) if SERVER in config.compare and workloads else contextlib.nullcontext()
    with server as measure_served:
        for _ in range(config.repeats):
            for workload in workloads:
                if speculating:  # the same engine without speculation, right before: the speed-up's baseline
                    plain = _without_speculation(llm, lambda: run_workload(llm, workload, progress=config.progress))
                    unspeculated[workload.id].append(plain)
                    _remember(llm, plain)
                measurements[workload.id].append(run_workload(llm, workload, progress=config.progress))
                if measure_served is not None:  # right after, so both see the machine in the same state
                    served[workload.id].append(measure_served(workload))
    result.runs += [_run_result(workload, "autodeploy", measurements[workload.id]) for workload in workloads]
    result.runs += [_run_result(workload, SERVER, served[workload.id]) for workload in workloads if served]
    result.runs += [_run_result(workload, NO_SPECULATION, unspeculated[workload.id]) for workload in workloads if unspeculated]
    synthetic = [w for w in workloads if w.kind == "synthetic"]
    baselines = [engine for engine in config.compare if engine in BASELINE_ENGINES]
    if baselines and len(synthetic) < len(workloads):
        logger.warning("baselines run the synthetic workloads only: HF generate() has no in-flight batching for arrival streams")
    device, vision = llm.engine.device, llm.engine.vision  # read before freeing: ``llm.engine`` would build it again
    if baselines:
        llm.free_kv_cache()  # the pool takes most of a GPU; the baselines need room for their own caches
    for engine in baselines:
        from autodeploy.bench.hf_baselines import hf_generate_timing, load_hf_model

        model = load_hf_model(llm.model_directory, _torch_dtype(settings.dtype), device)
        # Untimed, as the engine's warm-up above: the first generate() pays one-off CUDA and cuBLAS setup.
        hf_generate_timing(model, [[1] * 8], output_len=4, mode="hf-eager")
        for workload in synthetic:
            result.runs.append(_run_result(workload, engine, _hf_measurements(config, workload, engine, model, device, vision)))
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _ratios(result)
    if "accuracy" in config.workloads:
        result.accuracy = _accuracy(config, llm)
    return result


@contextlib.contextmanager
def _served(llm, workloads: list[Workload], warm_up: Workload, config: BenchmarkConfig) -> Iterator[Callable[[Workload], RunMeasurement]]:
    """``llm`` behind the OpenAI server in a thread, and a client in a spawned process; yields ``measure(workload)``."""
    from autodeploy.bench.http_runner import measure_over_http, probe_server
    from autodeploy.serve import ServerOptions, build_app
    from autodeploy.serve.server import serving_in_thread

    # As deep a queue as the in-process runner has: the server must not refuse what the engine would queue.
    options = ServerOptions(served_model_name="autodeploy-bench", max_queued_requests=max(256, *(len(w.requests) for w in workloads)),
                            stream_interval=config.server_stream_interval)
    spawn = multiprocessing.get_context("spawn")  # not fork: this process has threads (the engine's, uvicorn's)
    with serving_in_thread(build_app(llm, options)) as url, ProcessPoolExecutor(1, mp_context=spawn) as client:
        target = probe_server(url, timeout_s=config.request_timeout)

        def measure(workload: Workload, warm_up: bool = False) -> RunMeasurement:
            llm.engine.pool.reset_prefix_cache()  # the in-process run just prefilled the same prompts
            measured = client.submit(measure_over_http, target, workload, config.progress and not warm_up).result()
            _wait_until_idle(llm.engine, config.request_timeout)  # a failed request's abort may still be on its way
            return _from_http(measured, workload, url, warm_up)

        measure(warm_up, warm_up=True)
        yield measure


def _from_http(measured: HttpMeasurement, workload: Workload, url: str, warm_up: bool) -> RunMeasurement:
    """A failure in the (untimed) warm-up, or of every request of a point, stops the run with the server's reason;
    otherwise the point's failures are counted and reported beside its metrics."""
    if measured.failures and (warm_up or not measured.timings):
        raise ConfigError(f"{'the warm-up' if warm_up else workload.id}: {len(measured.failures)} of {len(workload.requests)} "
                          f"requests to the server at {url} failed, e.g. {measured.failures[0]}")
    return RunMeasurement(measured.timings, None, None, None, None, failures=measured.failures)


def _wait_until_idle(engine, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)


def _run_against_url(config: BenchmarkConfig) -> BenchResult:
    """The workloads through a server that is already running; nothing is built here."""
    from autodeploy import deployment_settings
    from autodeploy.bench.http_runner import measure_over_http, probe_server

    target = probe_server(config.url, config.served_model_name, config.api_key, config.request_timeout)
    settings, factory = deployment_settings(config.model, config.config_files, config.set_arguments)
    vocab_size = factory.hf_config.get_text_config().vocab_size
    tokenizer = factory.load_tokenizer(settings.tokenizer) if config.dataset else None
    max_seq_len = target.max_model_len or settings.max_seq_len
    workloads = build_workloads(config, vocab_size, max_seq_len, tokenizer)

    def measure(workload: Workload, warm_up: bool = False) -> RunMeasurement:
        return _from_http(measure_over_http(target, workload, config.progress and not warm_up), workload, target.url, warm_up)

    try:
        measure(synthetic_workload(2, 8, 4, vocab_size, max_seq_len, seed=config.seed + 1), warm_up=True)
    except ConfigError as error:
        raise ConfigError(f"{error} (the prompts are token ids of {settings.model or 'the demo model'}'s vocabulary: "
                          "give the served model as MODEL)") from None
    measurements: dict[str, list[RunMeasurement]] = defaultdict(list)
    for _ in range(config.repeats):
        for workload in workloads:
            measurements[workload.id].append(measure(workload))
    return BenchResult(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine={"device": "remote", "device_name": f"server at {target.url}", "client": platform.node(),
                 "cpu_count": os.cpu_count(), "python": platform.python_version()},
        model=target.model,
        settings={"url": target.url, "max_model_len": target.max_model_len, "vocabulary_of": str(settings.model or "demo model")},
        build={"total_s": 0.0, "stages": {}},
        runs=[_run_result(workload, SERVER, measurements[workload.id]) for workload in workloads],
    )


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
