"""Where an encoder–decoder's decode step time goes on the GPU (issue 44: BART-large's TPOT grew ~0.1 ms a sequence,
1.0 ms at batch 1 and 7.9 ms at 64, where the step's memory floor is under 1 ms — in float32; in bfloat16 the steps
that encode new requests took ~18 ms against 2.7 ms for decodes alone, dtype-independent, so not compute).

Random weights, ``N`` requests (default 64) of ``--input-len`` encoder tokens arrive together and generate
``--output-len`` tokens. Prints each step's wall time and kind (how many chunks, whether the decode graphs served it),
then a profile of ``--profile-steps`` decode steps once all are decoding: the CUDA kernels by time, and the host
time the steps took beyond the device's. ``--profile-encoding`` profiles the first ``--profile-steps`` steps instead,
those that encode new requests beside the decodes.

    python3 scripts/profile_encdec_decode.py [MODEL] [N] [--input-len 512] [--output-len 128] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import time

import torch

from autodeploy import SamplingParams, autodeploy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="bart-large")
    parser.add_argument("requests", nargs="?", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--profile-encoding", action="store_true")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # the CPU: a smoke run
    llm = autodeploy(args.model, weights="random", max_batch_size=args.requests, set_arguments=args.sets)
    print(llm.pipeline_report())
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + 131 * r) % 30000 + 10 for i in range(args.input_len)] for r in range(args.requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    graphs = getattr(runner, "decode_graphs", None)  # a CUDA-graph runner's
    replays = []
    if graphs is not None:
        replay = graphs.replay
        graphs.replay = lambda size, n: (replays.append(size), replay(size, n))[1]
    for prompt in prompts:
        engine.add_request(prompt, params)
    if args.profile_encoding:
        profile(engine, args.profile_steps, f"steps encoding {args.requests} new requests of {args.input_len} tokens", sync)
    steps = []
    while engine.has_unfinished() and len(steps) < args.output_len // 2:
        before, began = len(replays), time.perf_counter()
        engine.step()
        sync()
        steps.append((time.perf_counter() - began, len(replays) > before, engine.encoder.encoded))
    print("steps (ms, graph replayed, requests encoded so far): " +
          ", ".join(f"{1e3 * s:.1f}{' graph' if g else ''} ({e})" for s, g, e in steps))
    if not args.profile_encoding:
        profile(engine, args.profile_steps, f"decode steps at batch {args.requests}", sync)
    while engine.has_unfinished():
        engine.step()


def profile(engine, steps: int, what: str, sync) -> None:
    """The torch profiler over ``steps`` engine steps: the kernels by device time, then wall against kernel time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        sync()
        wall = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - wall
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total", row_limit=25))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))
    cuda = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in cuda) / 1e6
    print(f"{steps} {what}: wall {1e3 * wall / steps:.2f} ms a step, "
          f"CUDA kernels {1e3 * total / steps:.2f} ms a step; the rest is host time the device waited for")


if __name__ == "__main__":
    main()
