"""The ``autodeploy`` command line: run, serve, router, batch, build, triton-repo, quantize, config show, check, models, plan,
inspect, tune, bench.

Errors print as one line (``error: …``) with exit code 1; ``--debug`` shows the traceback.
``bench --baseline`` exits with code 3 when a metric regressed. ``--debug`` and ``--version`` go
before or after the subcommand. Building the parser imports neither torch nor transformers (each
handler imports what it needs), so ``--help`` and ``--version`` answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import socket
import sys
import time
from importlib import metadata

from autodeploy.errors import AutoDeployError, ConfigError

DEFAULT_PROMPT = "def fibonacci(n):"


def _installed_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _version_line() -> str:
    """Read from package metadata, so ``--version`` imports neither torch nor transformers."""
    others = ", ".join(f"{package} {_installed_version(package)}" for package in ("torch", "transformers"))
    return f"autodeploy {_installed_version('autodeploy')} ({others}, python {platform.python_version()})"


def _add_global_flags(parser: argparse.ArgumentParser, version_line: str, top_level: bool) -> None:
    # Only the top level has a default: a subcommand's default would overwrite a --debug given before it.
    parser.add_argument("--debug", action="store_true", default=False if top_level else argparse.SUPPRESS,
                        help="show tracebacks and debug logs")
    parser.add_argument("--verbose", "-v", action="store_true", default=False if top_level else argparse.SUPPRESS,
                        help="show info logs: where a build's or a server's start-up time went, what each stage did")
    parser.add_argument("--version", action="version", version=version_line, help="print the versions and exit")


def _add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML pipeline config merged over configs/default.yaml (repeatable, later wins)")
    parser.add_argument("--set", dest="set_arguments", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting, e.g. --set transforms.cleanup_noop.enabled=false (repeatable)")
    speculative = parser.add_argument_group("speculative decoding (docs/speculative.md; --set speculative.KEY=VALUE for the rest)")
    for flag, key, kind, what in SPECULATIVE_FLAGS:
        speculative.add_argument(flag, dest=f"speculative_{key}", type=kind, default=None, help=f"{what} (= --set speculative.{key}=…)")


# Flags that stand for --set speculative.<key>=<value>: (flag, key, type, help).
SPECULATIVE_FLAGS = (
    ("--speculative-method", "method", str, "draft tokens with: ngram, draft (a smaller model), eagle3 (a head), mtp (the "
                                           "checkpoint's MTP layer) or a registered drafter"),
    ("--speculative-num-tokens", "num_tokens", int, "tokens drafted per sequence and step"),
    ("--speculative-tree-width", "tree_width", int, "eagle3 / mtp: draft a tree, this many candidates at each depth"),
    ("--speculative-model", "model", str, "the draft model's checkpoint (method draft) or the head's folder (eagle3)"),
)


def _with_speculative_flags(args: argparse.Namespace) -> None:
    """Put the --speculative-* flags in front of the command's --set arguments (an explicit --set still wins)."""
    if not hasattr(args, "set_arguments"):
        return
    flags = [f"speculative.{key}={getattr(args, 'speculative_' + key)}" for _, key, _, _ in SPECULATIVE_FLAGS
             if getattr(args, "speculative_" + key, None) is not None]
    args.set_arguments[:0] = flags


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand with its flags and help; imports nothing heavy (each handler imports what it needs).

    >>> build_parser().parse_args(["config", "show", "--debug"]).debug
    True
    """
    version_line = _version_line()
    parser = argparse.ArgumentParser(prog="autodeploy", description="Hugging Face causal LM → fast inference engine.")
    _add_global_flags(parser, version_line, top_level=True)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="deploy a model and generate from a prompt")
    run.add_argument("model", nargs="?", default=None, help="checkpoint folder, hub id, config.json, shipped config name or a "
                     "deployment saved by `autodeploy build` (default: the embedded demo model)")
    run.add_argument("--prompt", action="append", default=[], help=f"prompt text (repeatable; default {DEFAULT_PROMPT!r})")
    run.add_argument("--max-tokens", type=int, default=48)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--min-p", type=float, default=0.0)
    run.add_argument("--repetition-penalty", type=float, default=1.0)
    run.add_argument("--presence-penalty", type=float, default=0.0)
    run.add_argument("--frequency-penalty", type=float, default=0.0)
    run.add_argument("--n", type=int, default=1, help="completions per prompt")
    run.add_argument("--beam-width", type=int, default=1, help="> 1: beam search (with --temperature 0)")
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--image", action="append", default=[], metavar="PATH_OR_URL",
                     help="a vision-language model: an image for every prompt, one <image> in the prompt each (repeatable)")
    run.add_argument("--stream", action="store_true",
                     help="print tokens as they come (one prompt; with --n > 1 the samples print one after another)")
    for flag, setting, what in (("--tp", "tensor_parallel", "tensor parallel over N ranks"),
                                ("--pp", "pipeline_parallel", "pipeline parallel over N stages"),
                                ("--ep", "expert_parallel", "MoE experts placed over N ranks")):
        run.add_argument(flag, type=int, default=None, metavar="N", dest=setting,
                         help=f"{what} (= --set distributed.{setting}=N): one process a rank, spawned here, or started "
                              f"by `torchrun --nproc-per-node WORLD -m autodeploy run …` (rank 0 prints)")
    _add_settings_arguments(run)

    serve = commands.add_parser("serve", help="deploy a model and serve it over an OpenAI-compatible HTTP API "
                                               "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)")
    serve.add_argument("model", nargs="?", default=None, help="as for run (default: the embedded demo model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; 0.0.0.0 accepts other machines)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API's routes (/v1/*, /tokenize, "
                                                      "/detokenize, /tokenizer_info)")
    serve.add_argument("--api-key-scope", default="api", choices=("api", "all"),
                       help="what --api-key guards: the API's routes (api: /health, /metrics and /docs stay open), or every "
                            "route but /health (all)")
    serve.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template overriding the tokenizer's")
    serve.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL as given)")
    serve.add_argument("--tool-call-format", default="auto", choices=("auto", "hermes", "json"),
                       help="how tool calls are generated: <tool_call> tags (hermes), a bare {\"name\", \"parameters\"} object "
                            "(json, Llama 3.x), or the one the chat template teaches (auto)")
    serve.add_argument("--max-queued-requests", type=int, default=256,
                       help="how many admitted requests may wait for a seat in the batch; more wait in a lobby (--queue-timeout)")
    serve.add_argument("--queue-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="how long a request waits for room in the queue before it is refused (503 + Retry-After); "
                            "0 refuses at once (default 30)")
    serve.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024, metavar="BYTES",
                       help="refuse request bodies larger than this (413) before reading them (default 16 MiB)")
    serve.add_argument("--reasoning-parser", default="none", choices=("none", "think"),
                       help="think: a chat answer's <think>…</think> block goes to message.reasoning_content (Qwen3, DeepSeek-R1, …)")
    serve.add_argument("--batch-dir", default=None, metavar="DIR",
                       help="turn on /v1/files and /v1/batches (OpenAI's Batch API), kept in DIR: a server started again on "
                            "DIR carries on with the batch that was running (docs/batch.md)")
    serve.add_argument("--role", default="both", choices=("both", "prefill", "decode"),
                       help="disaggregated serving (docs/disaggregated.md): a prefill worker computes prompts and hands their KV "
                            "cache to decode workers, which generate; `autodeploy router` sends requests through both. "
                            "both (default): a plain server")
    serve.add_argument("--kv-port", type=int, default=0, help="--role prefill: the KV transfer's gRPC port (default: any free one)")
    serve.add_argument("--etcd", default=None, metavar="URL", help="register this worker in etcd at URL (e.g. "
                       "http://127.0.0.1:2379), where routers find it; without it, give the router this worker's URL")
    serve.add_argument("--advertise-url", default=None, metavar="URL",
                       help="the URL routers reach this worker at (default: http://HOST:PORT)")
    serve.add_argument("--kv-hold-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="--role prefill: how long a prompt's KV blocks wait for a decode worker to pull them")
    serve.add_argument("--stream-interval", type=int, default=1, metavar="N",
                       help="a stream's chunks after the first carry N new tokens each (default 1): fewer events, longer gaps")
    _add_settings_arguments(serve)

    router = commands.add_parser("router", help="the OpenAI-compatible front end of disaggregated serving: sends each request "
                                                 "to a prefill worker, then a decode worker (docs/disaggregated.md)")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--etcd", default=None, metavar="URL", help="find workers in etcd at URL (they register with serve --etcd)")
    router.add_argument("--namespace", default="autodeploy", help="the etcd key prefix the workers registered under")
    router.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill worker's URL (static; repeat)")
    router.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode worker's URL (static; repeat)")
    router.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS", help="a request's deadline at a worker")
    router.add_argument("--stall-timeout", type=float, default=120.0, metavar="SECONDS",
                        help="a stream that sends nothing for this long counts its worker as hung, and resumes on another")

    batch = commands.add_parser("batch", help="run a file of requests in the OpenAI Batch API's format through a model, "
                                               "resumably (docs/batch.md)")
    batch.add_argument("model", nargs="?", default=None, help="as for run (default: the embedded demo model)")
    batch.add_argument("--input", required=True, metavar="FILE",
                       help="JSONL, one request a line: {custom_id, method: POST, url: /v1/completions | /v1/chat/completions, body}")
    batch.add_argument("--output", required=True, metavar="FILE",
                       help="JSONL results, appended as they finish; run the command again to finish a job that stopped")
    batch.add_argument("--columns", default=None, metavar="FIELD=COLUMN,…",
                       help="a Parquet, Arrow or datasets input: prompt=COLUMN (completions), messages=COLUMN (chat) or "
                            "input=COLUMN (embeddings), and optionally custom_id=COLUMN (default prompt=prompt; ids row-0, row-1, …)")
    batch.add_argument("--url", default=None, choices=("/v1/completions", "/v1/chat/completions", "/v1/embeddings"),
                       help="a table's route (default: the one its prompt, messages or input column implies)")
    batch.add_argument("--body", default=None, metavar="JSON",
                       help='a table\'s parameters for every row, e.g. \'{"max_tokens": 128, "temperature": 0}\'')
    batch.add_argument("--concurrency", type=int, default=None, metavar="N",
                       help="requests in flight at once (default: twice the engine's max_batch_size)")
    batch.add_argument("--served-model-name", default=None, help="the model a line's body may name (default: MODEL as given)")
    batch.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template overriding the tokenizer's")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_settings_arguments(batch)

    build = commands.add_parser("build", help="deploy a model and save the deployment to a folder that `autodeploy run DIR` "
                                               "serves without export or transforms")
    build.add_argument("model", nargs="?", default=None, help="checkpoint folder, hub id, config.json or shipped config name (default: the embedded demo model)")
    build.add_argument("--out", required=True, metavar="DIR", help="folder to write (new, empty, or an earlier deployment, which is replaced)")
    _add_settings_arguments(build)

    triton_repo = commands.add_parser("triton-repo", help="deploy a model and write a Triton Inference Server model repository: "
                                                          "the engine (streaming), tokenizer steps, an ensemble (notes/triton.md)")
    triton_repo.add_argument("model", nargs="?", default=None, help="as for build (default: the embedded demo model)")
    triton_repo.add_argument("--out", required=True, metavar="DIR", help="folder to write (new or empty)")
    triton_repo.add_argument("--blocklist", default=None, metavar="FILE",
                             help="add an output filter step to the ensemble: terms (one a line) whose whole-word matches it acts on")
    triton_repo.add_argument("--blocklist-action", default="redact", choices=("redact", "refuse"),
                             help="redact: replace each match with [redacted]; refuse: cut the answer at the first match and "
                                  "end it with a refusal (finish_reason content_filter)")
    triton_repo.add_argument("--stream-interval", type=int, default=1, metavar="N",
                             help="a stream's responses after the first come every N tokens (default 1); a request's "
                                  "stream_interval input overrides it")
    triton_repo.add_argument("--decoupled", default="true", choices=("true", "false"),
                             help="true: the llm and ensemble models stream (any number of responses a request); false: "
                                  "exactly one response a request, which Triton's plain infer needs (no streaming)")
    _add_settings_arguments(triton_repo)

    quantize = commands.add_parser("quantize", help="quantize a checkpoint as the quantize settings say and write it as a "
                                                     "compressed-tensors checkpoint folder that autodeploy (and vLLM) serve")
    quantize.add_argument("model", help="checkpoint folder or hub id of the float model")
    quantize.add_argument("--out", required=True, metavar="DIR", help="folder to write (new or empty)")
    _add_settings_arguments(quantize)

    config = commands.add_parser("config", help="configuration commands")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the merged settings (with auto values resolved when a model is given)")
    show.add_argument("model", nargs="?", default=None)
    show.add_argument("--explain", action="store_true", help="with MODEL: each setting that sizes the deployment with its reason "
                      "and the numbers behind it, the KV pool among them (docs/planning.md)")
    _add_settings_arguments(show)

    check = commands.add_parser("check", help="whether and how a model deploys, from its config.json alone (no weights "
                                              "are read or downloaded); exit code 3 when it does not deploy")
    check.add_argument("model", help="checkpoint folder, config.json, hub id or shipped config name")
    check.add_argument("--device", action="append", default=None, metavar="PROFILE",
                       help="device profiles to plan for (default: H200, H100, 8×H200 and the Jetson Orin profiles; "
                            "`autodeploy plan --list-devices` lists them)")
    check.add_argument("--trust-remote-code", action="store_true")

    models = commands.add_parser("models", help="the shipped model configs (`autodeploy run NAME --set weights=random` deploys one)")

    plan = commands.add_parser("plan", help="the settings for a model on a device profile, each with its reason, the memory "
                                            "they leave and the predicted decode speed; and the YAML to deploy it with")
    plan.add_argument("model", nargs="?", default=None)
    plan.add_argument("--device", default="h200", metavar="PROFILE", help="a device profile, NxPROFILE for N of them (default h200)")
    plan.add_argument("--context", type=int, default=None, help="tokens a sequence (default: the model's maximum, at most 8,192)")
    plan.add_argument("--concurrency", type=int, default=32, help="sequences at once the KV pool should hold (default 32)")
    plan.add_argument("--quantize", default="auto", help="auto (default), none, or a scheme (fp8, int8_wo, int4_awq, …)")
    plan.add_argument("--weights", default="checkpoint", choices=("checkpoint", "random"))
    plan.add_argument("--out", default=None, metavar="FILE", help="write the settings as YAML (for --config FILE)")
    plan.add_argument("--list-devices", action="store_true", help="list the device profiles and exit")

    inspect = commands.add_parser("inspect", help="op histogram and node count after every stage, time per transform")
    inspect.add_argument("model", nargs="?", default=None)
    inspect.add_argument("--device", default="meta", help="meta (default: no weights needed), cpu or cuda")
    _add_settings_arguments(inspect)

    tune = commands.add_parser("tune", help="time the kernel candidates of every node now and print the decision table "
                                             "(later builds reuse the decisions from autotuner.cache_dir)")
    tune.add_argument("model", nargs="?", default=None)
    _add_settings_arguments(tune)

    bench = commands.add_parser("bench", help="latency/throughput/memory/accuracy benchmarks, baselines, regression check")
    bench.add_argument("model", nargs="?", default=None)
    bench.add_argument("--workload", default="synthetic", help="comma list of synthetic, poisson, concurrency, accuracy")
    bench.add_argument("--batch", default="1,8", help="synthetic: batch sizes (comma list)")
    bench.add_argument("--input-len", default="128", help="synthetic: prompt lengths (comma list)")
    bench.add_argument("--output-len", default="128", help="synthetic: output lengths (comma list)")
    bench.add_argument("--rate", default="1", help="poisson: arrival rates in requests/s (comma list)")
    bench.add_argument("--concurrency", default="8", help="concurrency: max requests in flight (comma list)")
    bench.add_argument("--num-requests", type=int, default=32, help="poisson/concurrency: requests per point")
    bench.add_argument("--input-dist", default="uniform:32:256", help="poisson/concurrency: fixed:N | uniform:LOW:HIGH | normal:MEAN:STD")
    bench.add_argument("--output-dist", default="uniform:16:128", help="poisson/concurrency: output length distribution")
    bench.add_argument("--dataset", default=None, help="poisson/concurrency: JSONL file of prompts instead of random ones")
    bench.add_argument("--images-per-request", type=int, default=0, metavar="N",
                       help="a vision-language model: N images (random pixels, JPEG) before every prompt")
    bench.add_argument("--image-size", type=int, default=336, metavar="PIXELS", help="--images-per-request: their width and height")
    bench.add_argument("--same-image", action="store_true",
                       help="--images-per-request: one image for every request (encoder cache hits) instead of each its own")
    bench.add_argument("--perplexity-text", default=None, help="accuracy: also the perplexity on this text file")
    bench.add_argument("--repeats", type=int, default=3,
                       help="measurements per point (their spread feeds the regression check: 2 or more with --baseline)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--compare", default="", help="in the same run: hf-eager, hf-compile (synthetic points through HF), server "
                       "(every point again through the OpenAI server over the same engine, over HTTP) (comma list)")
    bench.add_argument("--url", default=None, help="measure a running OpenAI-compatible server (e.g. autodeploy serve) at this "
                       "base URL instead of building an engine; MODEL only gives the prompts' vocabulary")
    bench.add_argument("--served-model-name", default=None, help="--url: the model to request (default: the one /v1/models lists)")
    bench.add_argument("--server-stream-interval", type=int, default=1, metavar="N",
                       help="--compare server: the server streams N tokens an event (autodeploy serve --stream-interval)")
    bench.add_argument("--api-key", default=None, help="--url: sent as 'Authorization: Bearer KEY'")
    bench.add_argument("--request-timeout", type=float, default=120.0,
                       help="over HTTP: seconds a request may wait for its next byte before it counts as failed")
    bench.add_argument("--out", default=None, help="write the results as JSON")
    bench.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots (matplotlib) into DIR")
    bench.add_argument("--baseline", default=None, help="results JSON to compare with; exit code 3 on a regression")
    bench.add_argument("--threshold", type=float, default=0.05, help="relative change that counts as a regression (with noise)")
    bench.add_argument("--threads", type=int, default=None, help="CPU threads for torch (fewer threads measure more steadily on a shared machine)")
    bench.add_argument("--no-progress", action="store_true")
    _add_settings_arguments(bench)
    for subcommand in (run, serve, router, check, models, plan, build, triton_repo, quantize, config, show, inspect, tune, bench):
        _add_global_flags(subcommand, version_line, top_level=False)
    return parser


def _number_list(text: str, kind, option: str) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values:
        raise ConfigError(f"{option} expects a comma-separated list of {kind.__name__}s, got {text!r}")
    return values


def _bench(args) -> int:
    from autodeploy.bench.benchmark import BenchmarkConfig, run_benchmark
    from autodeploy.bench.regression import compare_results
    from autodeploy.bench.report import format_table
    from autodeploy.bench.results import load_result

    config = BenchmarkConfig(
        model=args.model,
        config_files=args.config,
        set_arguments=args.set_arguments,
        workloads=[w.strip() for w in args.workload.split(",") if w.strip()],
        batch=_number_list(args.batch, int, "--batch"),
        input_len=_number_list(args.input_len, int, "--input-len"),
        output_len=_number_list(args.output_len, int, "--output-len"),
        rates=_number_list(args.rate, float, "--rate"),
        concurrency=_number_list(args.concurrency, int, "--concurrency"),
        num_requests=args.num_requests,
        input_dist=args.input_dist,
        output_dist=args.output_dist,
        dataset=args.dataset,
        perplexity_text=args.perplexity_text,
        repeats=args.repeats,
        seed=args.seed,
        compare=[e.strip() for e in args.compare.split(",") if e.strip()],
        progress=not args.no_progress,
        url=args.url,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        request_timeout=args.request_timeout,
        server_stream_interval=args.server_stream_interval,
        images_per_request=args.images_per_request,
        image_size=args.image_size,
        same_image=args.same_image,
    )
    config.validate()
    if args.threshold <= 0:
        raise ConfigError(f"--threshold must be > 0, got {args.threshold}")
    if args.baseline and args.repeats < 2:
        raise ConfigError(
            f"--baseline needs --repeats 2 or more (got {args.repeats}): with one repeat there is no spread to tell "
            "machine noise from a regression"
        )
    baseline = load_result(args.baseline) if args.baseline else None  # a bad baseline fails before any measurement
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be ≥ 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    result = run_benchmark(config)
    print(format_table(result))
    if args.out:
        result.save(args.out)
    if args.plot:
        from autodeploy.bench.plots import write_plots

        for path in write_plots(result, args.plot):
            print(f"plot: {path}")
    if baseline is not None:
        for what in ("model", "machine"):
            if getattr(baseline, what) != getattr(result, what) and (what != "machine" or baseline.machine["device_name"] != result.machine["device_name"]):
                print(f"warning: the baseline's {what} differs from this run's; the comparison may say more about that than about the code", file=sys.stderr)
        report = compare_results(baseline, result, threshold=args.threshold)
        print()
        print(report.format_table())
        if report.regressed:
            print(f"regression against {args.baseline}", file=sys.stderr)
            return 3
    return 0


def _run(args) -> None:
    from autodeploy import autodeploy

    parallelism = [f"distributed.{name}={getattr(args, name)}" for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel")
                   if getattr(args, name) is not None]
    llm = autodeploy(args.model, config=args.config, set_arguments=[*parallelism, *args.set_arguments])
    try:
        with _rank_zero_prints():
            _generate(llm, args)
    finally:
        if llm.workers is not None:  # the worker processes this call spawned
            llm.shutdown()


@contextlib.contextmanager
def _rank_zero_prints():
    """Rank 0 of a world that torchrun started prints; the others generate the same tokens silently."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_rank() > 0):
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def _generate(llm, args) -> None:
    from autodeploy import SamplingParams
    from autodeploy.cli.completions import print_outputs, print_stream

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, n=args.n, beam_width=args.beam_width, seed=args.seed, stop=args.stop,
    )
    prompts = args.prompt or [DEFAULT_PROMPT]
    if args.stream and len(prompts) > 1:
        raise ConfigError("--stream prints the completions of one prompt as they come; give a single --prompt")
    requests = [{"prompt": prompt, "images": list(args.image)} for prompt in prompts] if args.image else prompts
    start = time.perf_counter()
    if args.stream:
        outputs = [print_stream(llm.stream(requests[0], params), prompts[0], params)]
    else:
        outputs = llm.generate(requests, params)
        print_outputs(outputs)
    seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"--- {generated} tokens in {seconds:.2f}s on {llm.settings.device} ({llm.settings.dtype})", file=sys.stderr)


def _bound_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` for uvicorn to serve on, before a build that may take minutes; not listening
    yet, so a client is refused rather than kept waiting while the engine builds."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a TCP port (0 to 65535)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)  # uvicorn's choice of family
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart need not wait out TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({error.strerror}); choose another --port or --host") from None
    return sock


def _serve(args) -> None:
    from pathlib import Path

    try:  # before a build that may take minutes
        from autodeploy.serve import ServerOptions, build_app, run_server
    except ImportError as error:
        raise ConfigError(f"autodeploy serve needs the serve extra ({error.name} is missing): pip install 'autodeploy[serve]'") from None
    if args.max_queued_requests < 1:
        raise ConfigError(f"--max-queued-requests must be ≥ 1, got {args.max_queued_requests}")
    if args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be ≥ 1, got {args.max_request_bytes}")
    if not args.queue_timeout >= 0:
        raise ConfigError(f"--queue-timeout must be ≥ 0 seconds, got {args.queue_timeout}")
    if args.stream_interval < 1:  # before a build that may take minutes
        raise ConfigError(f"--stream-interval must be ≥ 1, got {args.stream_interval}")
    if args.api_key_scope == "all" and args.api_key is None:
        raise ConfigError("--api-key-scope all needs --api-key KEY")
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = Path(args.chat_template).read_text()
        except OSError as error:
            raise ConfigError(f"--chat-template: cannot read {args.chat_template}: {error.strerror}") from None
    sock = _bound_socket(args.host, args.port)
    from autodeploy import autodeploy

    try:
        llm = autodeploy(args.model, config=args.config, set_arguments=args.set_arguments)
    except BaseException:
        sock.close()
        raise
    name = args.served_model_name or args.model or "autodeploy-demo"
    options = ServerOptions(served_model_name=name, api_key=args.api_key, api_key_scope=args.api_key_scope, chat_template=chat_template,
                            max_queued_requests=args.max_queued_requests, queue_timeout_s=args.queue_timeout,
                            max_request_bytes=args.max_request_bytes,
                            tool_call_format=args.tool_call_format,
                            stream_interval=args.stream_interval, reasoning_parser=args.reasoning_parser,
                            batch_dir=args.batch_dir)
    if args.role != "both" or args.etcd:
        from autodeploy.serve.disagg.worker import WorkerOptions

        options.disagg = WorkerOptions(role=args.role, url=args.advertise_url or f"http://{args.host}:{sock.getsockname()[1]}",
                                       kv_host=args.host, kv_port=args.kv_port, etcd=args.etcd, hold_ttl_s=args.kv_hold_timeout)
    run_server(build_app(llm, options), host=args.host, port=args.port, log_level="debug" if args.debug else "info", sock=sock)


def _router(args) -> None:
    try:
        from autodeploy.serve.disagg.router import RouterOptions, build_router_app
        from autodeploy.serve import run_server
    except ImportError as error:
        raise ConfigError(f"autodeploy router needs the serve and disagg extras ({error.name} is missing): "
                          f"pip install 'autodeploy[serve,disagg]'") from None
    options = RouterOptions(prefill=args.prefill, decode=args.decode, etcd=args.etcd, namespace=args.namespace,
                            timeout_s=args.request_timeout, stall_timeout_s=args.stall_timeout)
    app = build_router_app(options)
    run_server(app, host=args.host, port=args.port, log_level="debug" if args.debug else "info",
               sock=_bound_socket(args.host, args.port))


def _batch(args) -> None:
    from pathlib import Path

    try:  # before a build that may take minutes
        from autodeploy.serve.batch_job import read_batch_input, run_batch_file
        import httpx  # noqa: F401  (the routes are called in process through it)
        import fastapi  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"autodeploy batch needs the serve extra ({error.name} is missing): pip install 'autodeploy[serve]'") from None
    if args.concurrency is not None and args.concurrency < 1:
        raise ConfigError(f"--concurrency must be ≥ 1, got {args.concurrency}")
    if not Path(args.input).exists():
        raise ConfigError(f"--input {args.input}: no such file or folder")
    options = {}
    if args.chat_template is not None:
        try:
            options["chat_template"] = Path(args.chat_template).read_text()
        except OSError as error:
            raise ConfigError(f"--chat-template: cannot read {args.chat_template}: {error.strerror}") from None
    columns = None
    if args.columns is not None:
        pairs = [pair.partition("=") for pair in args.columns.split(",") if pair]
        if not pairs or any(not field or not sep or not column for field, sep, column in pairs):
            raise ConfigError(f"--columns takes FIELD=COLUMN pairs separated by commas, got {args.columns!r}")
        columns = {field.strip(): column.strip() for field, _, column in pairs}
    body = None
    if args.body is not None:
        import json

        try:
            body = json.loads(args.body)
        except ValueError as error:
            raise ConfigError(f"--body is not JSON: {error}") from None
        if not isinstance(body, dict):
            raise ConfigError(f"--body must be a JSON object of request parameters, got {args.body!r}")
    read_batch_input(args.input, args.output, columns, args.url, body)  # the files' errors before the build
    from autodeploy import autodeploy

    llm = autodeploy(args.model, config=args.config, set_arguments=args.set_arguments)
    name = args.served_model_name or args.model or "autodeploy-demo"
    summary = run_batch_file(llm, args.input, args.output, served_model_name=name, concurrency=args.concurrency,
                             progress=not args.no_progress, server_options=options, columns=columns, url=args.url, body=body)
    print(summary.line())


def _build(args) -> None:
    from pathlib import Path

    from autodeploy import autodeploy
    from autodeploy.artifact import check_save_destination

    check_save_destination(Path(args.out))  # before a build that may take minutes
    start = time.perf_counter()
    llm = autodeploy(args.model, config=args.config, set_arguments=args.set_arguments)
    built = time.perf_counter() - start
    directory = llm.save(args.out)
    size_mb = sum(path.stat().st_size for path in directory.rglob("*") if path.is_file()) / 1e6
    print(f"saved {directory} ({size_mb:.1f} MB; built in {built:.1f}s, saved in {time.perf_counter() - start - built:.1f}s "
          f"on {llm.settings.device} {llm.settings.dtype}); serve it with: autodeploy "
          f"{'run' if 'generate' in llm.tasks else 'serve'} {directory}")


def _triton_repo(args) -> None:
    from pathlib import Path

    from autodeploy import autodeploy
    from autodeploy.serve.triton import Blocklist, write_model_repository
    from autodeploy.serve.triton.repository import check_repository_destination, check_stream_interval

    out = Path(args.out)
    check_repository_destination(out)  # before a build that may take minutes
    check_stream_interval(args.stream_interval)
    blocklist = Blocklist.from_file(args.blocklist, args.blocklist_action) if args.blocklist else None
    start = time.perf_counter()
    llm = autodeploy(args.model, config=args.config, set_arguments=args.set_arguments)
    directory = write_model_repository(llm, out, blocklist, source=args.model, stream_interval=args.stream_interval,
                                       decoupled=args.decoupled == "true")
    print(f"wrote {directory} in {time.perf_counter() - start:.1f}s; serve it with: "
          f"python -m autodeploy.serve.triton.launch {directory} (in an environment with nvidia-pytriton, notes/triton.md)")


def _quantize(args) -> None:
    from autodeploy.quantized_checkpoint import quantize_checkpoint

    start = time.perf_counter()
    directory = quantize_checkpoint(args.model, args.out, args.config, args.set_arguments)
    size_mb = sum(path.stat().st_size for path in directory.rglob("*") if path.is_file()) / 1e6
    print(f"wrote {directory} ({size_mb:.1f} MB in {time.perf_counter() - start:.1f}s); serve it with: autodeploy run {directory}")


def _config_show(args) -> None:
    from autodeploy import deployment_settings  # through the package: it registers the built-in transforms
    from autodeploy.config import load_settings, settings_to_yaml

    if args.model is None and not any(a.startswith("model=") for a in args.set_arguments):
        print(settings_to_yaml(load_settings(args.config, None, args.set_arguments)), end="")
        return
    settings, factory = deployment_settings(args.model, args.config, args.set_arguments)
    print(settings_to_yaml(settings), end="")
    if args.explain:
        import torch

        from autodeploy.planning import current_profile
        from autodeploy.planning.check import model_shape
        from omegaconf import OmegaConf

        from autodeploy.planning.explain import explain_settings

        device = torch.device(settings.device)
        profile, how = current_profile(device) if device.type != "meta" else (None, "")
        if profile is None:
            print("# --explain: device is meta (nothing is allocated); give device=cpu or cuda")
            return
        raw = OmegaConf.to_container(load_settings(args.config, None, args.set_arguments))
        print("\n# why:")
        for line in explain_settings(settings, raw, model_shape(factory), profile, how):
            print(f"#   {line}")


def _check(args) -> int:
    from autodeploy.planning.check import SUMMARY_DEVICES, check_model

    report = check_model(args.model, tuple(args.device or SUMMARY_DEVICES), args.trust_remote_code)
    print(report.text())
    return 0 if report.deploys else 3


def _models(args) -> None:
    from autodeploy.models.source import shipped_model_configs
    from autodeploy.planning.check import check_model

    print(f"{'name':<16} {'architecture':<38} {'parameters':>11}  coverage")
    for name in shipped_model_configs():
        report = check_model(name, devices=())
        parameters = f"{report.shape.parameters / 1e9:.2f} B" if report.shape is not None else "-"
        print(f"{name:<16} {report.architecture:<38} {parameters:>11}  {report.verdict.split(':')[0]}")
    print("deploy one with random weights: autodeploy run NAME --set weights=random (or autodeploy plan NAME --device …)")


def _plan(args) -> None:
    from pathlib import Path

    from autodeploy.models.factory import ModelFactory
    from autodeploy.models.source import resolve_model_source
    from autodeploy.planning import PROFILES, PlanRequest, plan, profile
    from autodeploy.planning.check import model_shape
    from autodeploy.planning.estimate import calibrated

    if args.list_devices:
        for name, known in PROFILES.items():
            print(f"{name:<14} {known.description}: {known.usable_bytes / 2**30:.1f} GiB usable, {known.bandwidth / 1e9:,.0f} GB/s, "
                  f"compute capability {'.'.join(map(str, known.compute_capability))}{', FP8' if known.fp8 else ''}")
        return
    device = profile(args.device)
    if args.context is not None and args.context < 1 or args.concurrency < 1:
        raise ConfigError(f"--context and --concurrency must be ≥ 1; got {args.context} and {args.concurrency}")
    factory = ModelFactory.from_source(resolve_model_source(args.model, "random"))
    request = PlanRequest(context=args.context, concurrency=args.concurrency, quantize=args.quantize, weights=args.weights)
    result = plan(model_shape(factory), device, request, calibrated(device.base_name), model=args.model or "autodeploy-demo")
    print(result.explain())
    print("\n# settings (autodeploy run|serve MODEL --config FILE):")
    print(result.to_yaml(), end="")
    if args.out:
        Path(args.out).write_text(result.to_yaml())


def _inspect(args) -> None:
    import resource

    from autodeploy import autodeploy

    start = time.perf_counter()
    set_arguments = [f"device={args.device}", *args.set_arguments]
    if args.device == "meta" and not any(a.startswith("weights=") for a in args.set_arguments):
        set_arguments.insert(0, "weights=random")
    llm = autodeploy(args.model, config=args.config, set_arguments=set_arguments)
    print(llm.pipeline_report())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"wall time {time.perf_counter() - start:.1f}s, peak RSS {peak_mb:.0f} MB, device {llm.settings.device}")


def _tune(args) -> None:
    from autodeploy import autodeploy

    start = time.perf_counter()
    llm = autodeploy(args.model, config=args.config, set_arguments=["autotuner.enabled=true", *args.set_arguments])
    record = next((r for r in llm.records if r.name == "select_kernels"), None)
    if record is None:
        raise ConfigError("the pipeline has no select_kernels transform to tune; enable transforms.select_kernels")
    print("\n".join(record.details))
    print(f"tuned in {time.perf_counter() - start:.1f}s (whole build) on {llm.settings.device} ({llm.settings.dtype})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _with_speculative_flags(args)
    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    handlers = {"run": _run, "serve": _serve, "router": _router, "check": _check, "models": _models, "plan": _plan, "batch": _batch, "build": _build, "triton-repo": _triton_repo, "quantize": _quantize, "config": _config_show, "inspect": _inspect, "tune": _tune,
                "bench": _bench}
    try:
        code = handlers[args.command](args)
    except AutoDeployError as error:
        if args.debug:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`autodeploy plan … | head`): nothing more to say to it
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # the interpreter's flush at exit would raise again
        return 0
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
