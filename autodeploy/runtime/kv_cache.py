"""The device side of the paged KV cache: per-layer block tensors, and how many blocks fit.

On a GPU the pool takes ``memory_fraction`` of the memory that is free once the weights are loaded and
a warm-up forward at the full token budget has shown the activations' peak; on the CPU it takes a byte
budget. Either way it never takes more than ``max_batch_size`` full-length sequences could use, plus
room for the prefix cache on GPU (blocks parked there are reused, so extra memory is not wasted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from autodeploy.custom_ops.serving_signature import KVCacheSpec
from autodeploy.errors import AutoDeployError

logger = logging.getLogger(__name__)


def allocate_kv_caches(specs: Sequence[KVCacheSpec], num_blocks: int, block_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``{k_cache_i: [num_blocks, block_size, Hkv, D], v_cache_i: …}``, zero-filled."""
    caches = {}
    for spec in specs:
        caches[spec.key_input] = torch.zeros(num_blocks, block_size, spec.kv_heads, spec.head_dim, dtype=spec.dtype, device=device)
        caches[spec.value_input] = torch.zeros(num_blocks, block_size, spec.kv_heads, spec.value_head_dim, dtype=spec.dtype, device=device)
    return caches


def move_kv_entries(caches: dict[str, torch.Tensor], sources: torch.Tensor, targets: torch.Tensor) -> None:
    """Copy every layer's keys and values at flat slots ``sources`` to ``targets`` (all read before any is written)."""
    for cache in caches.values():
        flat = cache.view(-1, *cache.shape[2:])
        if cache.dtype == torch.float8_e4m3fn:  # no float8 index kernels on CPUs: move the bytes
            flat = flat.view(torch.uint8)
        flat.index_copy_(0, targets, flat.index_select(0, sources))


def _activation_peak(device: torch.device, warm_up: Callable[[int], None], num_tokens: int, allocated_before: int) -> int:
    torch.cuda.reset_peak_memory_stats(device)
    warm_up(num_tokens)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - allocated_before
    torch.cuda.empty_cache()
    return peak


def bytes_per_block(specs: Sequence[KVCacheSpec], block_size: int) -> int:
    return sum(spec.bytes_per_block(block_size) for spec in specs)


def plan_num_blocks(
    specs: Sequence[KVCacheSpec],
    kv_settings,
    max_batch_size: int,
    max_seq_len: int,
    device: torch.device,
    warm_up: Callable[[int], None],
    graph_tokens: int = 0,
) -> int:
    """How many blocks the pool gets (see the module docstring). ``warm_up(num_tokens)`` runs one forward
    (at most the token budget). With ``graph_tokens`` (the largest decode CUDA graph's batch), the
    activations of a forward of that many tokens are kept out of the budget too: captured graphs hold
    their memory for good."""
    block_size = kv_settings.block_size
    per_block = bytes_per_block(specs, block_size)
    full_batch = max_batch_size * -(-max_seq_len // block_size)
    if kv_settings.num_blocks is not None:
        return int(kv_settings.num_blocks)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free_before, _ = torch.cuda.mem_get_info(device)
        allocated_before = torch.cuda.memory_allocated(device)
        activations = _activation_peak(device, warm_up, max_seq_len, allocated_before)  # capped at the token budget
        graphs = _activation_peak(device, warm_up, graph_tokens, allocated_before) if graph_tokens else 0
        budget = kv_settings.memory_fraction * (free_before - activations - graphs)
        num_blocks = int(budget // per_block)
        logger.info(
            "KV cache: %.1f GiB free after weights, %.2f GiB activations at the token budget, %.2f GiB for decode "
            "graphs → %d blocks (%.1f GiB)",
            free_before / 2**30, activations / 2**30, graphs / 2**30, num_blocks, num_blocks * per_block / 2**30,
        )
    else:
        num_blocks = min(int(kv_settings.cpu_bytes // per_block), full_batch)
    if num_blocks < 1:
        raise AutoDeployError(
            f"no memory is left for the KV cache (one block of {block_size} tokens needs {per_block / 2**20:.1f} MiB); "
            f"lower scheduler.max_num_tokens, raise kv_cache.memory_fraction / kv_cache.cpu_bytes, or use a smaller dtype"
        )
    return num_blocks
