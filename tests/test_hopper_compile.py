"""The Hopper compile check of the CPU session (tests/hopper_compile.py) finds what the interpreter lets by."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tests.hopper_compile import compile_for_hopper, describe_launch


@triton.jit
def _scale_kernel(x_ptr, out_ptr, scale_ptr, n, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    if HAS_SCALE:  # scale_ptr is None otherwise: the branch is pruned at compile time
        x = x * tl.load(scale_ptr)
    tl.store(out_ptr + offsets, x, mask=offsets < n)


@triton.jit
def _scale_kernel_unpruned(x_ptr, out_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    if n < 0:  # never true, so the interpreter never reads the None pointer; the compiler still lowers it
        x = x * tl.load(scale_ptr)
    tl.store(out_ptr + offsets, x, mask=offsets < n)


def launch(kernel, **constants) -> dict:
    x = torch.ones(8, dtype=torch.bfloat16)
    return describe_launch(getattr(kernel, "fn", kernel), (x, x.clone(), None, 8), dict(constants, BLOCK=8, num_warps=1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile for real")
def test_a_kernel_the_interpreter_runs_but_the_compiler_rejects_is_reported():
    failures = compile_for_hopper([launch(_scale_kernel, HAS_SCALE=False), launch(_scale_kernel_unpruned)])
    assert len(failures) == 1 and failures[0].startswith("_scale_kernel_unpruned"), failures
