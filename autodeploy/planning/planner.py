"""``plan``: the settings for a model on a device, each with its reason and the numbers behind it.

The planner is pure: a ``ModelShape``, a ``DeviceProfile`` and what the user asks for (context, concurrency,
quantization) in; a ``Plan`` out — choices, the memory they leave, predicted decode speed, and the YAML that deploys
it. Its rules, in order:

1. **dtype**: float32 on a CPU; else the checkpoint's, but bfloat16 only from compute capability 8.0 (older GPUs: float16).
2. **quantization × tensor parallelism**: the first scheme, at the smallest tensor-parallel size, whose KV pool holds
   ``concurrency`` sequences at half the context each (a model goes over more devices before its weights lose bits).
   Half, as for ``max_batch_size`` (and one whole sequence at least): a paged pool holds tokens, not sequences, and
   sequences are half full on average; asking every one for the whole context made the planner give up FP8 for int4
   on an H100 at 256 × 2,048 tokens, which decoded 0.43× as fast at that batch (int4's dequantizing GEMMs are
   compute-bound there). ``quantize="auto"`` tries the fastest that keeps accuracy first — FP8 where the GPU has FP8 tensor cores (compute capability ≥ 8.9), else none — then int8 weights, then
   INT4-AWQ (``int4_wo`` with random weights: AWQ calibrates on the checkpoint's). When nothing holds that many, the
   plan takes what holds the most, and when not even one sequence fits, a shorter context.
3. **max_batch_size**: the sequences the pool holds at half the context each (sequences are half full on average),
   at most 256.
4. **scheduler.max_num_tokens**: the largest of 8,192 … 256 whose forward's activations take ≤ 10% of the memory.

    from autodeploy.planning import plan, profile
    print(plan(shape, profile("orin-nano-8gb"), PlanRequest(context=4096)).explain())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from autodeploy.planning.devices import DeviceProfile
from autodeploy.planning.estimate import MemoryUse, ModelShape, Quantization, SpeedModel, activation_bytes, memory_use

MAX_BATCH = 256
TOKEN_BUDGETS = (8192, 4096, 2048, 1024, 512, 256)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PlanRequest:
    """What the deployment is for: ``context`` tokens a sequence (None: the model's maximum, at most 8,192),
    ``concurrency`` sequences at once, ``quantize`` ("auto", "none" or a scheme), ``weights`` ("checkpoint" or
    "random": calibrated schemes need the checkpoint's), and the KV pool's ``kv_cache`` settings."""

    context: int | None = None
    concurrency: int = 32
    quantize: str = "auto"
    weights: str = "checkpoint"
    dtype: str = "auto"
    memory_fraction: float = 0.9  # kv_cache.memory_fraction
    cpu_bytes: int = 1 << 30  # kv_cache.cpu_bytes


@dataclass(frozen=True)
class Choice:
    setting: str  # dotted, as --set takes it
    value: Any
    reason: str


@dataclass
class Plan:
    model: str
    device: DeviceProfile
    choices: list[Choice]
    memory: MemoryUse
    fits: bool
    decode_tokens_per_s: dict[int, float] = field(default_factory=dict)  # batch → predicted, at half the context
    notes: list[str] = field(default_factory=list)

    def value(self, setting: str) -> Any:
        return next(choice.value for choice in self.choices if choice.setting == setting)

    def settings(self) -> dict:
        """The choices as a nested settings mapping (what ``--config`` takes)."""
        nested: dict = {}
        for choice in self.choices:
            if choice.value is None:
                continue
            *path, key = choice.setting.split(".")
            node = nested
            for part in path:
                node = node.setdefault(part, {})
            node[key] = choice.value
        return nested

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.create(self.settings()))

    def explain(self) -> str:
        lines = [f"{self.model} on {self.device.name} ({self.device.description}, {self.device.count} device(s), "
                 f"{self.device.usable_bytes / 2**30:.1f} GiB usable each): {'fits' if self.fits else 'DOES NOT FIT'}"]
        lines += [f"  {choice.setting} = {choice.value}: {choice.reason}" for choice in self.choices]
        lines += [f"  memory: {line}" for line in self.memory.lines()]
        if self.decode_tokens_per_s:
            lines.append("  predicted decode: " + ", ".join(f"batch {batch} {rate:,.0f} tok/s" for batch, rate in self.decode_tokens_per_s.items()))
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def choose_dtype(shape: ModelShape, device: DeviceProfile, requested: str = "auto") -> tuple[str, str]:
    if requested != "auto":
        return requested, "as given"
    if device.name == "cpu":
        return "float32", "CPUs run bf16/fp16 matmuls slowly, and float32 is the correctness oracle's"
    checkpoint = shape.config_dtype if shape.config_dtype in DTYPE_BYTES else "bfloat16"
    if checkpoint == "bfloat16" and device.compute_capability < (8, 0):
        major, minor = device.compute_capability
        return "float16", f"the checkpoint is bfloat16, which compute capability {major}.{minor} has no tensor cores for"
    if checkpoint == "float32":
        return "float32", "the checkpoint's (float32 is exact to it; dtype=bfloat16 halves the bytes a step reads)"
    return checkpoint, "the checkpoint's"


def scheme_candidates(device: DeviceProfile, request: PlanRequest) -> list[Quantization]:
    """The quantizations ``quantize`` allows, fastest that keeps accuracy first; the last also stores the embedding
    table in int8 (what decides whether a model fits a small device at all)."""
    if request.quantize != "auto":
        return [Quantization.of(request.quantize)]
    if device.name == "cpu":
        return [Quantization()]
    int4 = "int4_awq" if request.weights == "checkpoint" else "int4_wo"
    first = "fp8" if device.fp8 else "none"
    return [Quantization.of(first), Quantization.of("int8_wo"), Quantization.of(int4), Quantization.of(int4, embedding="int8")]


def _scheme_reason(quantization: Quantization, device: DeviceProfile, request: PlanRequest, held: int, wanted: int,
                   faster_failed: list[Quantization]) -> str:
    scheme = quantization.default
    if request.quantize != "auto":
        return "as given"
    if quantization.embedding == "int8":
        return "quantize auto: memory demands it — even int4 projections leave no room unless the embedding table is int8 too"
    if scheme == "fp8":
        return (f"quantize auto: FP8 weights halve the bytes a decode step reads, and compute capability "
                f"{'.'.join(map(str, device.compute_capability))} has FP8 tensor cores (build-time verification checks the accuracy)")
    if scheme == "none":
        return "quantize auto: the full-precision weights fit" + ("" if device.compute_capability >= (8, 9) else " (no FP8 tensor cores here)")
    return (f"quantize auto: memory demands it — with {', '.join(q.default for q in faster_failed)} the KV pool would hold "
            f"fewer than {wanted} sequences at half the context ({held} at most)")


def plan(shape: ModelShape, device: DeviceProfile, request: PlanRequest = PlanRequest(), speed: SpeedModel = SpeedModel(),
         model: str = "model") -> Plan:
    """The settings for ``shape`` on ``device`` (see the module docstring)."""
    dtype, dtype_reason = choose_dtype(shape, device, request.dtype)
    dtype_bytes = DTYPE_BYTES[dtype]
    model_max = shape.max_position_embeddings or 2048
    context = min(request.context or min(model_max, 8192), model_max)
    concurrency = max(1, request.concurrency)
    kv_bytes = dtype_bytes
    token_budget = 2048  # while the scheme is chosen; then the largest the memory left affords

    def use(tp: int, quantization: Quantization, ctx: int, batch: int) -> MemoryUse:
        return memory_use(shape, device, dtype_bytes=dtype_bytes, quantization=quantization, kv_dtype_bytes=kv_bytes, max_seq_len=ctx,
                          max_batch_size=batch, max_num_tokens=token_budget, tensor_parallel=tp,
                          memory_fraction=request.memory_fraction, cpu_bytes=request.cpu_bytes)

    sizes = [tp for tp in (1, 2, 4, 8) if tp <= device.count]
    schemes = scheme_candidates(device, request)
    # Schemes outermost: a model goes over more devices before its weights lose bits (FP8 on two GPUs before INT4 on one).
    tried: list[tuple[int, Quantization, MemoryUse]] = [(tp, scheme, use(tp, scheme, context, concurrency))
                                                        for scheme in schemes for tp in sizes]
    demand = max(context, concurrency * _half(context))  # tokens: half full on average, one whole at least (rule 2)
    holding = [(tp, scheme, m) for tp, scheme, m in tried if m.kv_tokens >= demand]
    notes = []
    if holding:
        tp, scheme, memory = holding[0]
    else:
        tp, scheme, memory = max(tried, key=lambda entry: (entry[2].kv_tokens, -entry[0], -entry[2].weights))
        if memory.kv_tokens < context:  # not one sequence: the longest context that one fits
            fitting = [ctx for ctx in _contexts(context) if use(tp, scheme, ctx, 1).kv_tokens >= ctx]
            if fitting:
                notes.append(f"{context:,} tokens a sequence do not fit even once; the context is cut to {fitting[0]:,}")
                context = fitting[0]
            memory = use(tp, scheme, context, 1)
        else:
            notes.append(f"{concurrency} sequences of {_half(context):,} tokens (half the context) do not fit; the pool holds "
                         f"{memory.kv_tokens // _half(context)} of them")
    faster = schemes[: schemes.index(scheme)]
    token_budget = _token_budget(shape, device, dtype_bytes, memory.weights, tp)
    batch = max(1, min(MAX_BATCH, memory.kv_tokens // _half(context)))
    memory = use(tp, scheme, context, batch)
    batch = max(1, min(MAX_BATCH, memory.kv_tokens // _half(context)))
    fits = memory.kv_tokens >= context and memory.num_blocks > 0
    if not fits:
        notes.append(f"the weights alone take {memory.weights / 2**30:.2f} GiB of {memory.usable / 2**30:.2f} GiB usable: a smaller "
                     f"model, or more devices" + (" (tensor parallelism)" if device.count == 1 else ""))
    reason = _scheme_reason(scheme, device, request, memory.kv_tokens // _half(context), concurrency, faster)
    choices = [
        Choice("dtype", dtype, dtype_reason),
        Choice("quantize.default", scheme.default, reason),
        *([Choice("quantize.experts", scheme.experts, f"MoE experts take int8 or int4 weights: the width nearest {scheme.default}")]
          if shape.experts else []),
        *([Choice("quantize.embedding", "int8", "see quantize.default")] if scheme.embedding == "int8" else []),
        Choice("distributed.tensor_parallel", tp,
               "one device holds it" if tp == 1 else f"the smallest of {sizes} whose KV pool holds {concurrency} sequences of "
                                                     f"{_half(context):,} tokens (half the context) with {scheme.default} weights"),
        Choice("max_seq_len", context, "as asked" if request.context and context == request.context else
               f"the model's maximum ({model_max:,})" if context == model_max else
               "cut to fit (see the notes)" if context < min(model_max, 8192) else
               f"the default planning context (the model takes up to {model_max:,}; ask for more with --context)"),
        Choice("max_batch_size", batch, f"the KV pool's {memory.kv_tokens:,} tokens hold {batch} sequences at half the context "
                                        f"({context // 2:,} tokens) each" + (f", capped at {MAX_BATCH}" if batch == MAX_BATCH else "")),
        Choice("scheduler.max_num_tokens", token_budget, f"the largest budget whose forward's activations "
                                                         f"({memory.activations / 2**30:.2f} GiB) take ≤ 10% of what the weights leave"),
    ]
    rates = {}
    if fits:
        for size in sorted({1, min(32, batch), batch}):
            rates[size] = speed.decode_tokens_per_s(shape, device, size, context // 2, dtype_bytes=dtype_bytes, quantization=scheme,
                                                     kv_dtype_bytes=kv_bytes, tensor_parallel=tp)
        notes.append(f"speed model: {speed.source}")
    return Plan(model, device, choices, memory, fits, rates, notes)


def _half(context: int) -> int:
    """A sequence's expected length: half the context (sequences are half full on average; rules 2 and 3)."""
    return max(1, context // 2)


def _token_budget(shape: ModelShape, device: DeviceProfile, dtype_bytes: int, weights: int, tensor_parallel: int) -> int:
    if device.name == "cpu":
        return 2048  # the default: a CPU's memory is its host's
    left = max(0, device.usable_bytes - weights)
    for budget in TOKEN_BUDGETS:
        if activation_bytes(shape, budget, dtype_bytes, 32, tensor_parallel) <= 0.10 * left:
            return budget
    return TOKEN_BUDGETS[-1]


def _contexts(context: int) -> list[int]:
    """Shorter contexts to try, longest first: halves down to 256."""
    sizes = []
    while context > 256:
        context //= 2
        sizes.append(context)
    return sizes
