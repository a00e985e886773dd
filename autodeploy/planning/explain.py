"""``autodeploy config show MODEL --explain``: each resolved setting that sizes a deployment, with its reason and the
numbers behind it — the KV pool the engine will allocate among them (on a CPU, exactly: the same rule, the same
numbers)."""

from __future__ import annotations

from autodeploy.planning.devices import DeviceProfile
from autodeploy.planning.estimate import ModelShape, Quantization, memory_use
from autodeploy.planning.planner import DTYPE_BYTES, choose_dtype

def explain_settings(settings, raw, shape: ModelShape, device: DeviceProfile, how_found: str) -> list[str]:
    """Lines explaining ``settings`` (resolved) against ``raw`` (as given, ``auto`` and unset values left), for ``shape``
    on ``device``."""
    quantize = settings.quantize
    quantization = Quantization(quantize.default, quantize.experts, quantize.embedding)
    dtype_bytes = DTYPE_BYTES[settings.dtype]
    kv_bytes = 1 if quantize.kv_cache == "fp8" else dtype_bytes
    tp = max(settings.distributed.tensor_parallel, 1)
    memory = memory_use(shape, device, dtype_bytes=dtype_bytes, quantization=quantization, kv_dtype_bytes=kv_bytes,
                        max_seq_len=settings.max_seq_len, max_batch_size=settings.max_batch_size,
                        max_num_tokens=settings.scheduler.max_num_tokens, block_size=settings.kv_cache.block_size,
                        memory_fraction=settings.kv_cache.memory_fraction, cpu_bytes=settings.kv_cache.cpu_bytes,
                        tensor_parallel=tp, cuda_graphs=settings.compile.backend in ("cuda_graph", "torch_compile_cuda_graph"))

    def origin(key: str, auto_reason: str) -> str:
        value = raw
        for part in key.split("."):
            value = value.get(part) if value is not None else None
        return f"auto: {auto_reason}" if value in ("auto", None) else "given (or the default)"

    lines = [f"device = {settings.device}: {origin('device', 'a CUDA GPU is visible' if settings.device == 'cuda' else 'no CUDA GPU')}; "
             f"profile {device.name} ({how_found})",
             f"dtype = {settings.dtype}: {origin('dtype', choose_dtype(shape, device)[1])}",
             f"quantize.default = {quantize.default}: {origin('quantize.default', _quantize_reason(quantize.default, device))}",
             f"max_seq_len = {settings.max_seq_len}: {origin('max_seq_len', f'the model’s max_position_embeddings ({shape.max_position_embeddings})')}",
             f"max_batch_size = {settings.max_batch_size}: {_switch(raw, 'batch')}; scheduler.max_num_tokens = "
             f"{settings.scheduler.max_num_tokens}: {_switch(raw, 'token_budget')}; distributed.tensor_parallel = "
             f"{settings.distributed.tensor_parallel}: {_switch(raw, 'tensor_parallel')}",
             f"weights: {shape.parameters / 1e9:.3f} B parameters → {memory.weights / 2**30:.3f} GiB a device"]
    if device.name == "cpu":
        full = settings.max_batch_size * -(-settings.max_seq_len // settings.kv_cache.block_size)
        lines.append(f"KV pool: min(kv_cache.cpu_bytes {settings.kv_cache.cpu_bytes:,} // {memory.bytes_per_block:,} B a block "
                     f"= {settings.kv_cache.cpu_bytes // memory.bytes_per_block:,}, max_batch_size × blocks a full sequence = {full:,}) "
                     f"= {memory.num_blocks:,} blocks of {memory.block_size} tokens ({memory.kv_tokens:,} tokens)")
    else:
        lines += [f"KV pool (estimated; the engine measures its activations at set-up): {line}" for line in memory.lines()]
    return lines


def kv_pool_blocks(lines: list[str]) -> int:
    """The block count an explanation states (what the tests hold against the engine's pool)."""
    line = next(line for line in lines if line.startswith("KV pool"))
    return int(line.split(" blocks of ")[0].rsplit("= ", 1)[1].replace(",", ""))


def _switch(raw, key: str) -> str:
    on = (raw.get("auto") or {}).get(key)
    return f"the planner's (auto.{key}; its reason is in the log)" if on else "given (or the default)"


def _quantize_reason(scheme: str, device: DeviceProfile) -> str:
    if scheme == "fp8":
        return "FP8 tensor cores here, and FP8 halves the bytes a decode step reads"
    if scheme == "none":
        return "the weights fit in the dtype" + ("" if device.fp8 else " (no FP8 tensor cores here)")
    return "the memory demands it"
