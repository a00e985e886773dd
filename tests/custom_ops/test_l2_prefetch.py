"""``prefetch_l2``: a hint that changes no value; its inline PTX assembles for Hopper (CPU), and on a GPU it
runs, inside a CUDA graph too, leaving every tensor as it was."""

import pytest
import torch

from autodeploy.custom_ops.triton.l2_prefetch import prefetch_l2

GPU = torch.cuda.is_available()


def test_it_is_a_no_op_on_the_cpu_and_for_what_it_cannot_fetch():
    weight = torch.randn(64, 64)
    before = weight.clone()
    prefetch_l2(weight)
    prefetch_l2(weight.t())  # not contiguous
    prefetch_l2(weight, max_bytes=8)  # less than one 16-byte unit
    assert torch.equal(weight, before)


def test_the_bulk_prefetch_compiles_for_hopper():
    from autodeploy.custom_ops.triton import l2_prefetch
    from tests.hopper_compile import compile_for_hopper, describe_launch

    kernel = getattr(l2_prefetch._prefetch_l2_kernel, "fn", l2_prefetch._prefetch_l2_kernel)
    for dtype in (torch.bfloat16, torch.uint8):
        launch = describe_launch(kernel, (torch.empty(4, dtype=dtype), 2**25 + 48), dict(
            SLICE=l2_prefetch._SLICE_BYTES, THREADS=l2_prefetch._THREADS, USE_PDL=True, num_warps=4, launch_pdl=True))
        assert compile_for_hopper([launch]) == []


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(4096, 4096), (6144, 4096), (3, 5)])
def test_on_the_gpu_it_runs_eagerly_and_in_a_graph_and_changes_nothing(shape):
    weight = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, shape[1], device="cuda", dtype=torch.bfloat16)
    before = weight.clone()
    prefetch_l2(weight)
    prefetch_l2(weight, max_bytes=1 << 20)
    want = x @ weight.t()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        prefetch_l2(weight)
        got = x @ weight.t()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        prefetch_l2(weight)
        got = x @ weight.t()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(weight, before) and torch.equal(got, want)
