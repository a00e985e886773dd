"""The ``autodeploy`` command line: run, config show, inspect.

Errors print as one line (``error: …``) with exit code 1; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from autodeploy.errors import AutoDeployError

DEFAULT_PROMPT = "def fibonacci(n):"


def _add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML pipeline config merged over configs/default.yaml (repeatable, later wins)")
    parser.add_argument("--set", dest="set_arguments", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting, e.g. --set transforms.cleanup_noop.enabled=false (repeatable)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autodeploy", description="Hugging Face causal LM → fast inference engine.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="deploy a model and generate from a prompt")
    run.add_argument("model", nargs="?", default=None, help="checkpoint folder, hub id, config.json or shipped config name (default: the embedded demo model)")
    run.add_argument("--prompt", action="append", default=[], help=f"prompt text (repeatable; default {DEFAULT_PROMPT!r})")
    run.add_argument("--max-tokens", type=int, default=48)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _add_settings_arguments(run)

    config = commands.add_parser("config", help="configuration commands")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the merged settings (with auto values resolved when a model is given)")
    show.add_argument("model", nargs="?", default=None)
    _add_settings_arguments(show)

    inspect = commands.add_parser("inspect", help="op histogram and node count after every stage, time per transform")
    inspect.add_argument("model", nargs="?", default=None)
    inspect.add_argument("--device", default="meta", help="meta (default: no weights needed), cpu or cuda")
    _add_settings_arguments(inspect)
    return parser


def _run(args) -> None:
    from autodeploy import SamplingParams, autodeploy

    llm = autodeploy(args.model, config=args.config, set_arguments=args.set_arguments)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop)
    prompts = args.prompt or [DEFAULT_PROMPT]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    for output in outputs:
        print(f"{output.prompt}\033[1m{output.text}\033[0m" if sys.stdout.isatty() else f"{output.prompt}{output.text}")
        print(f"--- {len(output.token_ids)} tokens, finish: {output.finish_reason}")
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"--- {generated} tokens in {seconds:.2f}s on {llm.settings.device} ({llm.settings.dtype})", file=sys.stderr)


def _config_show(args) -> None:
    from autodeploy.api import deployment_settings
    from autodeploy.config import load_settings, settings_to_yaml

    if args.model is None and not any(a.startswith("model=") for a in args.set_arguments):
        print(settings_to_yaml(load_settings(args.config, None, args.set_arguments)), end="")
        return
    settings, _ = deployment_settings(args.model, args.config, args.set_arguments)
    print(settings_to_yaml(settings), end="")


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


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    handlers = {"run": _run, "config": _config_show, "inspect": _inspect}
    try:
        handlers[args.command](args)
    except AutoDeployError as error:
        if args.debug:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
