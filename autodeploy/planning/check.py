"""``autodeploy check MODEL``: whether and how a model deploys, from its ``config.json`` alone.

Nothing but the config files is read (a hub id fetches ``*.json`` and the tokenizer's files: no weight). The model is
built on the meta device, which is where an architecture autodeploy cannot serve is refused, by name; the coverage
sweep's verdict for its model type (``autodeploy/assets/coverage.json``, written by ``scripts/coverage_sweep.py``)
says whether that family is exact against Hugging Face; then the planner (``planner.py``) gives each device profile
its fit, quantization and context, and the checkpoint's index its size on disk.

    report = check_model("meta-llama/Meta-Llama-3-8B")
    print(report.text())
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import torch

from autodeploy.errors import AutoDeployError
from autodeploy.planning.estimate import ModelShape, calibrated
from autodeploy.planning.planner import Plan, PlanRequest, plan

SUMMARY_DEVICES = ("h200", "h100", "8xh200", "orin-agx-64gb", "orin-agx-32gb", "orin-nx-16gb", "orin-nano-8gb")


@lru_cache(maxsize=1)
def coverage_table() -> dict[str, dict]:
    """The coverage sweep's verdicts by model type: family, status (exact / refused / n/a) and why."""
    return json.loads(resources.files("autodeploy").joinpath("assets/coverage.json").read_text())


@dataclass
class CheckReport:
    model: str
    model_type: str
    architecture: str
    kind: str  # "decoder", "vision-language", "encoder-decoder", "encoder"
    deploys: bool
    verdict: str  # one line: how it deploys, or why not
    shape: ModelShape | None = None
    checkpoint_bytes: int | None = None
    plans: dict[str, Plan] = field(default_factory=dict)

    def text(self) -> str:
        lines = [f"{self.model}: {self.architecture} ({self.model_type}, {self.kind})",
                 f"  {'deploys' if self.deploys else 'does not deploy'}: {self.verdict}"]
        if self.shape is not None:
            shape = self.shape
            moe = f", {shape.num_experts} experts ({shape.experts_per_token} a token)" if shape.num_experts else ""
            lines.append(f"  {shape.parameters / 1e9:.2f} B parameters ({shape.num_layers} layers, hidden {shape.hidden_size}, vocab "
                         f"{shape.vocab_size:,}{moe}); KV cache {shape.kv_bytes_per_token_bf16 / 1024:.0f} KiB a token in bf16; "
                         f"context up to {shape.max_position_embeddings or '?'}")
        if self.checkpoint_bytes:
            lines.append(f"  checkpoint: {self.checkpoint_bytes / 1e9:.2f} GB (its index)")
        if self.plans:
            lines.append("  per device (quantize auto, 32 sequences):")
            for name, device_plan in self.plans.items():
                quantize = device_plan.value("quantize.default")
                if device_plan.fits:
                    rate = device_plan.decode_tokens_per_s.get(1)
                    lines.append(f"    {name:<14} fits: quantize {quantize}, tensor_parallel {device_plan.value('distributed.tensor_parallel')}, "
                                 f"context {device_plan.value('max_seq_len'):,}, max_batch_size {device_plan.value('max_batch_size')}, "
                                 f"~{rate:,.0f} tok/s at batch 1")
                else:
                    lines.append(f"    {name:<14} does not fit (weights {device_plan.memory.weights / 2**30:.1f} GiB at least, "
                                 f"{device_plan.memory.usable / 2**30:.1f} GiB usable)")
        return "\n".join(lines)


def model_shape(factory) -> ModelShape:
    """The shape of a ``ModelFactory``'s model, built on meta (an architecture it cannot serve raises, naming why)."""
    return ModelShape.from_model(factory.build_meta_model(torch.bfloat16), factory.hf_config)


def check_model(model: str, devices: tuple[str, ...] = SUMMARY_DEVICES, trust_remote_code: bool = False) -> CheckReport:
    """See the module docstring. A model that cannot be served is a report that says so (not an error); one whose
    config cannot be found or read raises (``ModelNotFoundError``)."""
    from autodeploy.models.factory import ModelFactory, load_hf_config
    from autodeploy.models.source import resolve_model_source
    from autodeploy.planning.devices import profile

    source = resolve_model_source(model, "random")
    config = load_hf_config(source, trust_remote_code)
    model_type = config.model_type
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    factory = ModelFactory(source, config, trust_remote_code)
    try:
        kind = ("vision-language" if factory.vision_language is not None else "encoder-decoder" if factory.encoder_decoder is not None
                else "encoder" if factory.embedding is not None else "decoder")
        shape = model_shape(factory)
    except AutoDeployError as error:
        return CheckReport(model, model_type, architecture, "-", False, f"refused: {error}")
    table = coverage_table()  # an encoder–decoder's row is its "(seq2seq)" one (the plain one is its decoder alone)
    entry = (table.get(f"{model_type} (seq2seq)") if kind == "encoder-decoder" else None) or table.get(model_type)
    if entry is None:
        deploys, verdict = True, "its family is not in the coverage sweep: the build's verification on a reduced twin decides"
    elif entry["status"] == "exact":
        deploys, verdict = True, "exact: the coverage sweep's tiny model matched Hugging Face (logits and greedy tokens)"
    elif entry["status"] == "refused":
        deploys, verdict = False, f"refused by the coverage sweep: {entry.get('detail', '')}"
    else:
        deploys, verdict = True, f"not swept ({entry.get('detail', 'no tiny model')}): the build's verification decides"
    report = CheckReport(model, model_type, architecture, kind, deploys, verdict, shape, _checkpoint_bytes(source.directory))
    if deploys:
        for name in devices:
            device = profile(name)
            report.plans[name] = plan(shape, device, PlanRequest(concurrency=32), calibrated(device.base_name), model=model)
    return report


def _checkpoint_bytes(directory: Path) -> int | None:
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / name
        if index.is_file():
            try:
                return int(json.loads(index.read_text())["metadata"]["total_size"])
            except (ValueError, KeyError, TypeError):
                return None
    return None
