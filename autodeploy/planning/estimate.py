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
  of the two at the device's rates scaled by measured efficiencies, plus a per-step and a per-sequence overhead
  (sampling, scheduling, attention's launch) and, under tensor parallelism, two all-reduces a layer (an assumed 10 µs
  each over NVLink; not yet measured here, only single-GPU machines are lent). The defaults are fitted to H200 figures (Llama-3-8B shape, bf16: 243
  tok/s at batch 1, ~6,000 at 32); ``scripts/plan_vs_measured.py`` checks them on the device and saves a fitted model
  for its profile (``save_calibration``), which ``calibrated(profile)`` returns to the planner from then on.
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


# The share of the device's bandwidth a decode step's weight reads reach, by projection scheme. bf16 fitted to the H200's
# 243 tok/s (Llama-3-8B shape, batch 1), fp8 to its 348 (dynamic activation scales cost a pass a layer); the integer
# schemes are guesses until scripts/plan_vs_measured.py measures them.
SCHEME_EFFICIENCY = {"none": 0.85, "fp8": 0.66, "int8_wo": 0.6, "int4_wo": 0.5, "int4_awq": 0.5, "int4_gptq": 0.5, "smoothquant": 0.6}


@dataclass(frozen=True)
class SpeedModel:
    """Decode step time on a device (see the module docstring); efficiencies and overheads are fitted by a run.
    ``bandwidth_efficiency`` scales ``SCHEME_EFFICIENCY`` (1.0: as the table says; a fit sets it per device)."""

    bandwidth_efficiency: float = 1.0
    compute_efficiency: float = 0.55
    step_overhead_s: float = 1.0e-4
    sequence_overhead_s: float = 3.5e-5
    allreduce_s: float = 1.0e-5  # one all-reduce of a decode step's rows over NVLink (two a layer under tensor parallelism)
    source: str = "defaults fitted to H200 figures (Llama-3-8B shape: bf16 243 tok/s at 1, ~6,000 at 32; fp8 348 at 1)"

    def decode_step_s(self, shape: ModelShape, device: DeviceProfile, batch: int, context: int, *, dtype_bytes: int,
                      quantization: Quantization = Quantization(), kv_dtype_bytes: int = 2, tensor_parallel: int = 1) -> float:
        active = shape.active_parameters(batch)
        share = active / shape.parameters if shape.parameters else 1.0
        weights = weight_bytes(shape, dtype_bytes, quantization, tensor_parallel) * share
        kv = batch * context * shape.kv_bytes_per_token(kv_dtype_bytes) / tensor_parallel
        efficiency = SCHEME_EFFICIENCY.get(quantization.default, 0.6) * self.bandwidth_efficiency
        memory_s = (weights + kv) / (device.bandwidth * min(1.0, efficiency))
        rate = device.fp8_flops if quantization.default == "fp8" and device.fp8_flops else device.bf16_flops
        compute_s = 2 * (active - shape.embedding) * batch / tensor_parallel / (rate * self.compute_efficiency)
        communication_s = 2 * shape.num_layers * self.allreduce_s if tensor_parallel > 1 else 0.0
        return max(memory_s, compute_s) + communication_s + self.step_overhead_s + self.sequence_overhead_s * batch

    def decode_tokens_per_s(self, shape: ModelShape, device: DeviceProfile, batch: int, context: int, **kwargs) -> float:
        return batch / self.decode_step_s(shape, device, batch, context, **kwargs)


def calibration_file() -> Path:
    """``$XDG_CACHE_HOME/autodeploy/speed_models.json`` (or ``~/.cache/…``): fitted speed models by device profile."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autodeploy" / "speed_models.json"


def calibrated(device: str) -> SpeedModel:
    """The speed model fitted on ``device`` (``save_calibration``), else the defaults."""
    try:
        fields = json.loads(calibration_file().read_text()).get(device)
    except (OSError, ValueError):
        return SpeedModel()
    return SpeedModel(**fields) if isinstance(fields, dict) else SpeedModel()


def save_calibration(device: str, model: SpeedModel) -> Path:
    path = calibration_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        models = json.loads(path.read_text())
    except (OSError, ValueError):
        models = {}
    models[device] = dataclasses.asdict(model)
    path.write_text(json.dumps(models, indent=1))
    return path


def fit_speed_model(points: list[tuple[int, float, float]], base: SpeedModel = SpeedModel()) -> SpeedModel:
    """``base`` refitted to measured decode steps ``(batch, step seconds base predicts, measured seconds)`` of one scheme:
    the bandwidth scale from the smallest batch (memory-bound: the step less its overheads), the per-sequence overhead
    from the largest (what is left of it after the memory part at the fitted scale and the per-step overhead)."""
    points = sorted(points)
    batch, predicted, measured = points[0]
    overhead = base.step_overhead_s + base.sequence_overhead_s * batch
    scale = base.bandwidth_efficiency * (predicted - overhead) / max(measured - overhead, 1e-9)
    sequence = base.sequence_overhead_s
    if len(points) > 1:
        batch, predicted, measured = points[-1]
        memory = (predicted - base.step_overhead_s - base.sequence_overhead_s * batch) * base.bandwidth_efficiency / scale
        sequence = max(0.0, (measured - memory - base.step_overhead_s) / batch)
    return SpeedModel(bandwidth_efficiency=round(scale, 4), compute_efficiency=base.compute_efficiency,
                      step_overhead_s=base.step_overhead_s, sequence_overhead_s=sequence, allreduce_s=base.allreduce_s,
                      source=f"fitted to {len(points)} measured decode steps")
