"""The scheduler under a closed-loop mixed-length workload, on a modelled clock (issue 48): where TTFT goes, and its floor.

The real ``Scheduler`` and ``KVBlockPool`` plan every step; a step of ``--model``'s shape (its config only) takes the longer of its weight and KV reads and its
matmuls at the device profile's rates (``autodeploy.planning``: bandwidth share from the speed model; prefill GEMMs at
``--prefill-efficiency`` of the bf16 rate, 0.77 being the 761 TFLOP/s measured for a 4,096-token prefill on the H200),
plus the speed model's per-step and per-sequence costs. ``autodeploy bench --workload concurrency`` admits its first
``--concurrency`` requests at once, so they arrive as one burst; the script prints TTFT over all requests and over those
admitted after the burst, and the burst's floor: its prompts' prefill FLOPs at the prefill rate, before which the last
of them cannot have a first token whatever the order.

    python scripts/simulate_schedule.py --device h200 --budgets 2048,8192
"""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

from autodeploy.models.factory import ModelFactory
from autodeploy.models.source import resolve_model_source
from autodeploy.planning import profile
from autodeploy.planning.check import model_shape
from autodeploy.planning.estimate import ModelShape, calibrated
from autodeploy.runtime.block_pool import KVBlockPool
from autodeploy.runtime.scheduler import Scheduler


class _Sequence:
    """What the scheduler reads of a sequence, and when its first token came."""

    def __init__(self, seq_id: int, prompt_len: int, output_len: int, arrival: float, in_burst: bool):
        self.seq_id, self.token_ids, self.num_computed, self.priority = seq_id, [seq_id] * prompt_len, 0, 0
        self.arrival, self.output_len, self.outputs, self.first_token, self.in_burst = (arrival, seq_id), output_len, 0, None, in_burst
        self.request = SimpleNamespace(content_spans=(), whole_spans=())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed


def step_seconds(plan, shape: ModelShape, device, speed, prefill_efficiency: float) -> float:
    scheme = speed.scheme("none")
    tokens = sum(chunk.length for chunk in plan.chunks)
    decodes = sum(chunk.length == 1 for chunk in plan.chunks)
    context = sum(chunk.start + chunk.length for chunk in plan.chunks)
    reads = (2 * shape.parameters + context * shape.kv_bytes_per_token(2)) / (device.bandwidth * scheme.bandwidth_efficiency)
    efficiency = scheme.compute_efficiency if tokens == decodes else prefill_efficiency
    matmuls = 2 * (shape.parameters - shape.embedding) * tokens / (device.bf16_flops * efficiency)
    return max(reads, matmuls) + speed.step_overhead_s + scheme.sequence_overhead_s * decodes


def simulate(args, shape: ModelShape, budget: int) -> dict:
    device, speed = profile(args.device), calibrated(profile(args.device).base_name)
    rng = random.Random(args.seed)
    low, high = map(int, args.input.split(":"))
    out_low, out_high = map(int, args.output.split(":"))
    work = [(rng.randint(low, high), rng.randint(out_low, out_high)) for _ in range(args.requests)]
    pool = KVBlockPool(args.kv_tokens // 16, 16)
    scheduler = Scheduler(pool, args.max_batch_size, budget)
    now, issued, finished, output_tokens = 0.0, 0, [], 0

    def admit(in_burst: bool) -> None:
        nonlocal issued
        prompt, output = work[issued]
        issued += 1
        scheduler.add(_Sequence(issued, prompt, output, now, in_burst))

    for _ in range(min(args.concurrency, args.requests)):
        admit(in_burst=True)
    while scheduler.has_work():
        plan = scheduler.schedule()
        now += step_seconds(plan, shape, device, speed, args.prefill_efficiency)
        for chunk in plan.chunks:
            sequence = chunk.sequence
            sequence.num_computed += chunk.length
            if sequence.num_computed < sequence.num_tokens:
                continue  # a prompt part-way
            sequence.outputs += 1
            output_tokens += 1
            sequence.first_token = now if sequence.first_token is None else sequence.first_token
            if sequence.outputs < sequence.output_len:
                sequence.token_ids.append(0)
                continue
            scheduler.remove(sequence)
            finished.append(sequence)
            if issued < args.requests:
                admit(in_burst=False)
    burst_tokens = sum(prompt for prompt, _ in work[: args.concurrency])
    floor = 2 * (shape.parameters - shape.embedding) * burst_tokens / (device.bf16_flops * args.prefill_efficiency)

    def p(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    ttft = [s.first_token - s.arrival[0] for s in finished]
    later = [s.first_token - s.arrival[0] for s in finished if not s.in_burst]
    return {"tok/s": output_tokens / now, "ttft p50": p(ttft, 0.5), "ttft p99": p(ttft, 0.99), "later p99": p(later, 0.99),
            "floor": floor, "burst tokens": burst_tokens, "preemptions": scheduler.num_preemptions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b", help="a config (shipped name, folder or hub id): its shape only")
    parser.add_argument("--device", default="h200")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--input", default="64:2048", help="uniform LOW:HIGH prompt tokens")
    parser.add_argument("--output", default="16:512", help="uniform LOW:HIGH output tokens")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--budgets", default="2048,8192", help="scheduler.max_num_tokens values to compare")
    parser.add_argument("--kv-tokens", type=int, default=400_000)
    parser.add_argument("--prefill-efficiency", type=float, default=0.77)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = model_shape(ModelFactory.from_source(resolve_model_source(args.model, "random")))
    for budget in map(int, args.budgets.split(",")):
        r = simulate(args, shape, budget)
        print(f"max_num_tokens {budget:>5}: {r['tok/s']:,.0f} output tok/s; TTFT p50 {r['ttft p50'] * 1e3:,.0f} ms, p99 "
              f"{r['ttft p99'] * 1e3:,.0f} ms (admitted after the burst: p99 {r['later p99'] * 1e3:,.0f} ms); "
              f"preemptions {r['preemptions']}")
    print(f"the burst: {args.concurrency} prompts, {r['burst tokens']:,} tokens, whose prefill alone takes {r['floor']:.2f} s at "
          f"{args.prefill_efficiency:.2f} of the bf16 rate: the last of them has no first token before that")


if __name__ == "__main__":
    main()
