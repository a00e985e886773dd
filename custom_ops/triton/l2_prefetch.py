"""Bring a weight into the GPU's L2 cache ahead of the kernel that reads it (Hopper's bulk L2 prefetch).

A decode step alternates kernels that stream weights at the memory's full rate (the projections) with
kernels that barely use it (RoPE and the cache write, attention over a few hundred keys, the norms and the
gated activation). :func:`prefetch_l2` issued at the start of such a stretch lets the memory fetch the next
projection's weight while they run, so that projection reads it from L2.

Each thread of the kernel issues one ``cp.async.bulk.prefetch.L2.global`` over its slice of the tensor's
bytes: a hint with no result, so the kernel ends as soon as the requests are issued and the copies run
on in the background. It changes no value anywhere. On a device without it (before compute capability
9.0, or the interpreter) it does nothing.

    from autodeploy.custom_ops.triton.l2_prefetch import prefetch_l2
    prefetch_l2(weight)                      # all of it
    prefetch_l2(weight, max_bytes=16 << 20)  # its first 16 MiB
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import dependent_launch, wait_for_previous_kernel

_THREADS = 128  # one slice a thread, four warps a program
_SLICE_BYTES = 8 << 10  # a program covers 1 MiB: a 32 MiB fetch spreads over 32 SMs


@triton.jit
def _prefetch_l2_kernel(ptr, nbytes, SLICE: tl.constexpr, THREADS: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    offsets = tl.program_id(0).to(tl.int64) * (SLICE * THREADS) + tl.arange(0, THREADS).to(tl.int64) * SLICE
    size = tl.minimum(tl.maximum(nbytes - offsets, 0), SLICE).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.pointer_type(tl.int8)) + offsets, size], dtype=tl.int32, is_pure=False, pack=1,
    )


@functools.lru_cache(maxsize=None)
def _has_bulk_prefetch(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def prefetch_l2(tensor: torch.Tensor, max_bytes: int | None = None) -> None:
    """Ask the memory to bring the first ``max_bytes`` (all by default) of ``tensor``'s contiguous storage
    into L2. Returns at once; a no-op on the CPU, before Hopper, and for tensors whose bytes do not start
    16-byte aligned or are not contiguous."""
    if tensor.device.type != "cuda" or not _has_bulk_prefetch(tensor.device.index) or not tensor.is_contiguous():
        return
    nbytes = tensor.numel() * tensor.element_size()
    nbytes = (min(nbytes, max_bytes) if max_bytes is not None else nbytes) // 16 * 16
    if nbytes == 0 or tensor.data_ptr() % 16:
        return
    grid = (triton.cdiv(nbytes, _SLICE_BYTES * _THREADS),)
    _prefetch_l2_kernel[grid](tensor, nbytes, SLICE=_SLICE_BYTES, THREADS=_THREADS, num_warps=_THREADS // 32,
                              **dependent_launch(tensor.device))
