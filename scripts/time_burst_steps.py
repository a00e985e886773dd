"""Where a burst's wall time goes, step by step: the bench's synthetic workload (B prompts of 128 tokens, 128
output tokens each, all submitted at once) run REPEATS times in one process, each engine.step() timed on the
host with what it planned (prefill tokens, decodes). The first burst after the bench's warm-up pays whatever
is done once per process at a new shape; later bursts show the steady state.

Run: [MODEL=...] python scripts/time_burst_steps.py [B] [REPEATS] [--set key=value ...]   (default 32, 3; llama-3-8b, random)
PROFILE_STEPS=N: the first N steps of the last burst under cProfile, their costliest functions printed after it.
EMPTY_SPLITS=first|last: the decode attention grid's empty splits launched first or last, overriding the
kernel's own choice (paged_attention._EMPTY_SPLITS_FIRST), to compare the two inside the engine.
"""

import cProfile
import os
import pstats
import statistics
import sys
import time

from autodeploy import autodeploy
from autodeploy.bench.runner import run_workload
from autodeploy.bench.workloads import synthetic_workload

positional = [a for a in sys.argv[1:3] if not a.startswith("--")]
BATCH = int(positional[0]) if positional else 32
REPEATS = int(positional[1]) if len(positional) > 1 else 3
SETS = [a for a in sys.argv[1 + len(positional):] if a != "--set"]

if os.environ.get("EMPTY_SPLITS"):
    from autodeploy.custom_ops.triton import paged_attention

    paged_attention._EMPTY_SPLITS_FIRST = {"first": True, "last": False}[os.environ["EMPTY_SPLITS"]]
MODEL = os.environ.get("MODEL", "llama-3-8b")  # "" is the demo model (a CPU check of this script)
llm = autodeploy(MODEL or None, **({"weights": "random"} if MODEL else {}), max_batch_size=max(BATCH, 8), set_arguments=SETS)
engine = llm.engine
plans: list[tuple[int, int]] = []
schedule = engine.scheduler.schedule


def recorded_schedule():
    plan = schedule()
    prefill = sum(c.length for c in plan.chunks if c.length > 1 or c.start < len(c.sequence.request.prompt_token_ids))
    plans.append((prefill, len(plan.chunks)))
    return plan


engine.scheduler.schedule = recorded_schedule
steps: list[tuple[float, float]] = []
step = engine.step
PROFILE_STEPS = int(os.environ.get("PROFILE_STEPS", "0"))
profile = cProfile.Profile() if PROFILE_STEPS else None
profiling = False


def timed_step():
    began = time.perf_counter()
    if profiling and len(steps) < PROFILE_STEPS:
        profile.enable()
        changed = step()
        profile.disable()
        steps.append((began, time.perf_counter()))
        return changed
    changed = step()
    steps.append((began, time.perf_counter()))
    return changed


engine.step = timed_step
run_workload(llm, synthetic_workload(2, 8, 4, llm.vocab_size, llm.settings.max_seq_len, seed=1), progress=False)
for repeat in range(REPEATS):
    plans.clear()
    steps.clear()
    profiling = profile is not None and repeat == REPEATS - 1
    workload = synthetic_workload(BATCH, 128, 128, llm.vocab_size, llm.settings.max_seq_len, seed=0)
    measurement = run_workload(llm, workload, progress=False)
    ttft = sorted(round(t.ttft * 1e3, 1) for t in measurement.timings)
    e2e = max(t.e2e for t in measurement.timings)
    origin = steps[0][0]
    print(f"burst {repeat}: B={BATCH} wall {e2e * 1e3:.1f} ms = {BATCH * 128 / e2e:.0f} output tok/s; "
          f"TTFT ms: {sorted(set(ttft))}")
    for index, ((began, ended), (prefill, chunks)) in enumerate(zip(steps, plans)):
        if index < 6 or index >= len(steps) - 2:
            print(f"  step {index:3d}: at {1e3 * (began - origin):7.1f} ms, host {1e3 * (ended - began):6.2f} ms, "
                  f"{prefill} prompt tokens, {chunks} chunks")
    # A call's interval (to the next call) is the step it launched: in the steady state, its GPU time.
    gaps = [b2 - b1 for (b1, _), (b2, _) in zip(steps, steps[1:])]
    decode_gaps = [gap for gap, (prefill, _) in zip(gaps, plans) if prefill == 0]
    print(f"  decode-only steps: {len(decode_gaps)}, median interval {1e3 * statistics.median(decode_gaps):.3f} ms, "
          f"mean {1e3 * statistics.mean(decode_gaps):.3f} ms")
if profile is not None:
    print(f"the first {PROFILE_STEPS} steps of the last burst, host time (cProfile):")
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
