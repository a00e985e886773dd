"""The memory and speed model: what a deployment of a model takes on a device, and how fast it decodes.

``ModelShape`` counts the model's parameters from its config alone (the HF model built on the meta device: no weight
is read) by kind — projections (what quantization shrinks), MoE experts, embedding, LM head, the rest — and reads
what one token's KV cache costs. From it:

- **memory** (``memory_use``): weights in the chosen dtype and quantization scheme; the KV pool (what is left after the
  weights, the activations of a forward at the token budget and the decode CUDA graphs, times
  ``kv_cache.memory_fraction``); on a CPU the KV pool is the engine's own rule (``kv_cache.cpu_bytes``, at most
  ``max_batch_size`` full sequences), so the numbers are the ones the engine then allocates.
- **speed** (``SpeedModel.decode_step_s``): a decode step reads every weight it uses once (a MoE layer: the experts
  its batch routes to) and each sequence's KV cache, and computes 2 FLOPs a parameter a token; it takes the longer
  of the two at the device's rates scaled by the scheme's measured shares (``SchemeSpeed``: an int4 weight-only GEMM
  reaches a far smaller share of the matmul rate than bf16's, so int4 loses to fp8 at large batches), plus a per-step
  and a per-sequence cost and, under tensor parallelism, two all-reduces a layer (an assumed 10 µs each over NVLink;
  not yet measured here, only single-GPU machines are lent). ``scripts/plan_vs_measured.py`` measures decode steps on
  the device, fits a model for its profile (``fit_scheme_speed``) and saves it (``save_calibration``);
  ``calibrated(profile)`` returns this machine's fit, else the one shipped for the profile
  (``autodeploy/assets/speed_models.json``), else the defaults.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from autodeploy.planning.devices import DeviceProfile
from autodeploy.preflight import kv_bytes_per_token

# Bytes a quantized projection parameter takes (group scales included: one fp16 scale and zero per 128 int4 values).
SCHEME_BYTES = {"int8_wo": 1.0, "fp8": 1.0, "smoothquant": 1.0, "int4_wo": 0.5 + 4 / 128, "int4_awq": 0.5 + 4 / 128,
                "int4_gptq": 0.5 + 4 / 128}
GRAPH_BYTES_PER_BATCH_ROW = 2 * 2**20  # a captured decode graph's private memory per padded row (measured ~1–3 MiB)
WORKSPACE_BYTES = 512 * 2**20  # cuBLAS / Triton workspaces, the sampler's buffers, allocator slack


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts by kind and the attention geometry, from a config."""

    model_type: str
    projections: int  # linear weights of the layers, experts excluded
    experts: int  # MoE expert weights
    embedding: int
    head: int  # 0 when tied to the embedding
    other: int  # norms, biases, routers
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_experts: int = 0
    experts_per_token: int = 0
    max_position_embeddings: int | None = None
    kv_bytes_per_token_bf16: int = 0
    config_dtype: str = "bfloat16"

    @classmethod
    def from_model(cls, model: nn.Module, config: PretrainedConfig) -> ModelShape:
        """From the HF model on the meta device (no weights) and its config."""
        text = config.get_text_config()
        head = model.get_output_embeddings()
        embedding = model.get_input_embeddings()
        seen: set[int] = set()
        counts = {"projections": 0, "experts": 0, "embedding": 0, "head": 0, "other": 0}
        head_weight = getattr(head, "weight", None)
        for name, parameter in model.named_parameters(remove_duplicate=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            if embedding is not None and parameter is embedding.weight:
                kind = "embedding"
            elif head_weight is not None and parameter is head_weight:
                kind = "head"
            elif ".experts." in f".{name}." or name.split(".")[-2:-1] == ["experts"]:
                kind = "experts"
            elif parameter.dim() == 2:
                kind = "projections"
            else:
                kind = "other"
            counts[kind] += parameter.numel()
        experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None)
        per_token = getattr(text, "num_experts_per_tok", None) or getattr(text, "num_experts_per_token", None)
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        return cls(config.model_type, counts["projections"], counts["experts"], counts["embedding"], counts["head"], counts["other"],
                   int(getattr(text, "num_hidden_layers", 0) or 0), int(getattr(text, "hidden_size", 0) or 0),
                   int(getattr(text, "vocab_size", 0) or 0), int(experts or 0), int(per_token or 0),
                   getattr(text, "max_position_embeddings", None), kv_bytes_per_token(config, torch.bfloat16),
                   str(dtype).removeprefix("torch."))

    @property
    def parameters(self) -> int:
        return self.projections + self.experts + self.embedding + self.head + self.other

    def active_parameters(self, batch: int = 1) -> float:
        """Parameters a decode step of ``batch`` sequences reads: a MoE layer's experts those sequences route to."""
        return self.parameters - self.experts + self.experts * self.expert_share(batch)

    def expert_share(self, batch: int) -> float:
        """The share of experts a batch touches (routing taken as uniform)."""
        if not self.num_experts or not self.experts_per_token:
            return 1.0
        untouched = (1 - self.experts_per_token / self.num_experts) ** batch
        return 1 - untouched

    def kv_bytes_per_token(self, kv_dtype_bytes: int) -> int:
        return self.kv_bytes_per_token_bf16 // 2 * kv_dtype_bytes


@dataclass(frozen=True)
class Quantization:
    """The ``quantize`` settings the model sees: ``default`` (projections and an untied LM head), ``experts`` (MoE
    experts, ``int8_wo`` / ``int4_wo`` / none) and ``embedding`` (``int8`` / none)."""

    default: str = "none"
    experts: str = "none"
    embedding: str = "none"

    @classmethod
    def of(cls, scheme: str, embedding: str = "none") -> Quantization:
        """``scheme`` for the projections, and the experts' scheme of the same width (experts take int8 or int4)."""
        experts = "none" if scheme == "none" else "int4_wo" if scheme.startswith("int4") else "int8_wo"
        return cls(scheme, experts, embedding)


def weight_bytes(shape: ModelShape, dtype_bytes: int, quantization: Quantization = Quantization(), tensor_parallel: int = 1) -> int:
    """Bytes of the weights on one device: projections and an untied head in the default scheme, experts in theirs,
    the embedding in int8 or the dtype, the rest in the dtype; under tensor parallelism the projections, experts and
    head are sliced, the embedding and norms are whole on every rank."""
    default = SCHEME_BYTES.get(quantization.default, dtype_bytes)
    experts = SCHEME_BYTES.get(quantization.experts, dtype_bytes)
    embedding = 1 + 4 / shape.hidden_size if quantization.embedding == "int8" and shape.hidden_size else dtype_bytes
    sliced = (shape.projections + shape.head) * default + shape.experts * experts
    return int(sliced / tensor_parallel + shape.embedding * embedding + shape.other * dtype_bytes)


@dataclass(frozen=True)
class MemoryUse:
    """One device's memory, in bytes (see ``memory_use``)."""

    usable: int
    weights: int
    activations: int
    graphs: int
    workspace: int
    kv_budget: int  # what the pool may take
    bytes_per_block: int
    num_blocks: int
    block_size: int

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def lines(self) -> list[str]:
        gib = 2**30
        return [f"usable {self.usable / gib:.2f} GiB − weights {self.weights / gib:.2f} − activations {self.activations / gib:.2f} "
                f"− decode graphs {self.graphs / gib:.2f} − workspace {self.workspace / gib:.2f} → KV budget {self.kv_budget / gib:.2f} GiB",
                f"KV pool: {self.num_blocks} blocks × {self.block_size} tokens × {self.bytes_per_block / self.block_size:.0f} B a token "
                f"= {self.num_blocks * self.bytes_per_block / gib:.2f} GiB ({self.kv_tokens:,} tokens)"]


def activation_bytes(shape: ModelShape, max_num_tokens: int, dtype_bytes: int, max_batch_size: int, tensor_parallel: int = 1) -> int:
    """A forward's peak at the token budget: a few hidden-size and intermediate rows a token live at once (the MLP's
    widest is ~3.5 × hidden: gate and up, then down's input), and the logits of every sequence in float32."""
    rows = max_num_tokens * shape.hidden_size * dtype_bytes * 8 // tensor_parallel
    logits = max_batch_size * shape.vocab_size * 4
    return rows + logits


def memory_use(shape: ModelShape, device: DeviceProfile, *, dtype_bytes: int, quantization: Quantization, kv_dtype_bytes: int, max_seq_len: int,
               max_batch_size: int, max_num_tokens: int, block_size: int = 16, memory_fraction: float = 0.9,
               cpu_bytes: int = 1 << 30, tensor_parallel: int = 1, cuda_graphs: bool = True) -> MemoryUse:
    """What one device holds. On a GPU the pool is ``memory_fraction`` of what the weights, the activations, the decode
    graphs and a workspace leave (as ``runtime/kv_cache.plan_num_blocks`` sizes it from free memory); on the CPU it is
    ``cpu_bytes``. Either way at most ``max_batch_size`` full-length sequences."""
    weights = weight_bytes(shape, dtype_bytes, quantization, tensor_parallel)
    per_block = shape.kv_bytes_per_token(kv_dtype_bytes) * block_size // tensor_parallel
    full_batch = max_batch_size * -(-max_seq_len // block_size)
    if device.name == "cpu":
        activations = graphs = workspace = 0
        budget = cpu_bytes
        blocks = min(budget // per_block, full_batch)
    else:
        activations = activation_bytes(shape, max_num_tokens, dtype_bytes, max_batch_size, tensor_parallel)
        graphs = GRAPH_BYTES_PER_BATCH_ROW * max_batch_size if cuda_graphs else 0
        workspace = WORKSPACE_BYTES
        budget = max(0, int(memory_fraction * (device.usable_bytes - weights - activations - graphs - workspace)))
        blocks = budget // per_block  # the prefix cache takes what full sequences leave (kv_cache.py)
    return MemoryUse(device.usable_bytes, weights, activations, graphs, workspace, budget, per_block, int(blocks), block_size)


@dataclass(frozen=True)
class SchemeSpeed:
    """How fast one projection scheme's decode step runs on a device, as shares of its datasheet rates: the weight and
    KV reads reach ``bandwidth_efficiency`` of its bandwidth; the matmuls, where they bound the step (large batches),
    ``compute_efficiency`` of its matmul rate (an int4 weight-only GEMM dequantizes in its inner loop: far below bf16's);
    each sequence adds ``sequence_overhead_s`` (attention over its pages, sampling, its rows of the small ops)."""

    bandwidth_efficiency: float
    compute_efficiency: float
    sequence_overhead_s: float


# For a device without a calibration. Bandwidth shares of bf16 and fp8 fitted to the H200 figures on record (Llama-3-8B
# shape, batch 1: 243 and 348 tok/s; fp8's dynamic activation scales cost a pass a layer); int4_wo's, the compute shares
# and the per-sequence costs fitted on an H100 (scripts/plan_vs_measured.py, 2026-12-08: batch 1, 32, 256); int8_wo and
# smoothquant are guesses between, the calibrated int4 schemes int4_wo's (the same kernels).
DEFAULT_SCHEME_SPEEDS = {
    "none": SchemeSpeed(0.85, 0.39, 1.3e-5),
    "fp8": SchemeSpeed(0.66, 0.2, 1.2e-5),
    "int8_wo": SchemeSpeed(0.6, 0.2, 2.0e-5),
    "smoothquant": SchemeSpeed(0.6, 0.2, 2.0e-5),
    "int4_wo": SchemeSpeed(0.5, 0.2, 3.1e-5),
    "int4_awq": SchemeSpeed(0.5, 0.2, 3.1e-5),
    "int4_gptq": SchemeSpeed(0.5, 0.2, 3.1e-5),
}
SAME_KERNELS = {"int4_awq": "int4_wo", "int4_gptq": "int4_wo"}  # served by int4_wo's kernels: its calibration holds


@dataclass(frozen=True)
class StepCost:
    """What one decode step moves and computes: ``bytes`` read (weights it uses, every sequence's KV cache), ``flops``
    of its matmuls, at the device's ``bandwidth`` and matmul ``rate`` (FP8's for fp8 projections)."""

    bytes: float
    flops: float
    bandwidth: float
    rate: float


def step_cost(shape: ModelShape, device: DeviceProfile, batch: int, context: int, *, dtype_bytes: int,
              quantization: Quantization = Quantization(), kv_dtype_bytes: int = 2, tensor_parallel: int = 1) -> StepCost:
    active = shape.active_parameters(batch)
    share = active / shape.parameters if shape.parameters else 1.0
    weights = weight_bytes(shape, dtype_bytes, quantization, tensor_parallel) * share
    kv = batch * context * shape.kv_bytes_per_token(kv_dtype_bytes) / tensor_parallel
    rate = device.fp8_flops if quantization.default == "fp8" and device.fp8_flops else device.bf16_flops
    flops = 2 * (active - shape.embedding) * batch / tensor_parallel
    return StepCost(weights + kv, flops, device.bandwidth, rate)


@dataclass(frozen=True)
class SpeedModel:
    """Decode step time on a device (see the module docstring): a ``SchemeSpeed`` a projection scheme (``schemes``; one
    not named there takes that of the scheme whose kernels serve it, else ``DEFAULT_SCHEME_SPEEDS``'), a per-step
    overhead, and the all-reduce of a step's rows."""

    schemes: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_SCHEME_SPEEDS))
    step_overhead_s: float = 1.0e-4
    allreduce_s: float = 1.0e-5  # one all-reduce of a decode step's rows over NVLink (two a layer under tensor parallelism)
    source: str = "defaults (bandwidth shares fitted to H200 figures, compute shares and per-sequence costs to an H100's)"

    def scheme(self, name: str) -> SchemeSpeed:
        """This model's speed for scheme ``name`` (or for the scheme whose kernels serve it), else the default's."""
        found = self.schemes.get(name) or self.schemes.get(SAME_KERNELS.get(name, name))
        return found or DEFAULT_SCHEME_SPEEDS.get(name) or DEFAULT_SCHEME_SPEEDS["int8_wo"]

    def decode_step_s(self, shape: ModelShape, device: DeviceProfile, batch: int, context: int, *, dtype_bytes: int,
                      quantization: Quantization = Quantization(), kv_dtype_bytes: int = 2, tensor_parallel: int = 1) -> float:
        cost = step_cost(shape, device, batch, context, dtype_bytes=dtype_bytes, quantization=quantization,
                         kv_dtype_bytes=kv_dtype_bytes, tensor_parallel=tensor_parallel)
        speed = self.scheme(quantization.default)
        memory_s = cost.bytes / (cost.bandwidth * min(1.0, speed.bandwidth_efficiency))
        compute_s = cost.flops / (cost.rate * speed.compute_efficiency)
        communication_s = 2 * shape.num_layers * self.allreduce_s if tensor_parallel > 1 else 0.0
        return max(memory_s, compute_s) + communication_s + self.step_overhead_s + speed.sequence_overhead_s * batch

    def decode_tokens_per_s(self, shape: ModelShape, device: DeviceProfile, batch: int, context: int, **kwargs) -> float:
        return batch / self.decode_step_s(shape, device, batch, context, **kwargs)

    def to_json(self) -> dict:
        return {"schemes": {name: dataclasses.asdict(speed) for name, speed in self.schemes.items()},
                "step_overhead_s": self.step_overhead_s, "allreduce_s": self.allreduce_s, "source": self.source}

    @classmethod
    def from_json(cls, fields: dict) -> SpeedModel:
        if not isinstance(fields.get("schemes"), dict):
            raise ValueError("a speed model without per-scheme speeds (an older calibration's layout)")
        schemes = {name: SchemeSpeed(**value) for name, value in fields.get("schemes", {}).items()}
        return cls(schemes, fields.get("step_overhead_s", 1.0e-4), fields.get("allreduce_s", 1.0e-5), fields.get("source", "calibrated"))


def calibration_file() -> Path:
    """``$XDG_CACHE_HOME/autodeploy/speed_models.json`` (or ``~/.cache/…``): fitted speed models by device profile."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autodeploy" / "speed_models.json"


SHIPPED_CALIBRATIONS = Path(__file__).resolve().parents[1] / "assets" / "speed_models.json"


def calibrated(device: str) -> SpeedModel:
    """The speed model fitted on ``device``: this machine's (``save_calibration``), else the one shipped for that profile
    (``autodeploy/assets/speed_models.json``, measured by ``scripts/plan_vs_measured.py``), else the defaults."""
    for path in (calibration_file(), SHIPPED_CALIBRATIONS):
        try:
            fields = json.loads(path.read_text()).get(device)
        except (OSError, ValueError):
            continue
        if isinstance(fields, dict):
            try:
                return SpeedModel.from_json(fields)
            except (TypeError, ValueError):  # an older file's layout: the defaults rather than a crash
                continue
    return SpeedModel()


def save_calibration(device: str, model: SpeedModel, path: Path | None = None) -> Path:
    path = path or calibration_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        models = json.loads(path.read_text())
    except (OSError, ValueError):
        models = {}
    models[device] = model.to_json()
    path.write_text(json.dumps(models, indent=1) + "\n")
    return path


def fit_scheme_speed(costs: list[tuple[int, StepCost, float]], base: SchemeSpeed, step_overhead_s: float) -> SchemeSpeed:
    """``base`` refitted to measured decode steps ``(batch, its StepCost, measured seconds)`` of one scheme, in three
    steps: the bandwidth share from the smallest batch (memory-bound), the per-sequence cost from the next (still
    memory-bound: what is left after the reads), the compute share from the largest where the step outlasts its reads
    (what is left after the per-sequence costs). With fewer batches the later steps keep ``base``'s values."""
    costs = sorted(costs, key=lambda entry: entry[0])
    first_batch, first, first_measured = costs[0]
    sequence = base.sequence_overhead_s
    for _ in range(20):  # the two depend on each other a little (the small batch's per-sequence cost): a fixed point
        bandwidth = first.bytes / first.bandwidth / max(first_measured - step_overhead_s - sequence * first_batch, 1e-9)
        if len(costs) == 1:
            break
        batch, cost, measured = costs[1] if len(costs) > 2 else costs[-1]
        sequence = max(0.0, (measured - cost.bytes / (cost.bandwidth * bandwidth) - step_overhead_s) / batch)
    compute = base.compute_efficiency
    if len(costs) > 2:
        batch, cost, measured = costs[-1]
        left = measured - step_overhead_s - sequence * batch
        if left > 1.05 * cost.bytes / (cost.bandwidth * bandwidth):  # compute-bound: the matmuls' share of the rate
            compute = cost.flops / (cost.rate * left)
    return SchemeSpeed(round(min(bandwidth, 1.0), 4), round(compute, 4), float(f"{sequence:.3g}"))
