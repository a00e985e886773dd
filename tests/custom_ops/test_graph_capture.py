"""A CUDA graph capture that fails leaves CUDA's random number generator usable (``capture_graph``), in the
engine's captures and the autotuner's timing alike."""

from __future__ import annotations

import pytest
import torch

from autodeploy.autotuner.timing import _graphed_median_seconds
from autodeploy.custom_ops.graph_capture import capture_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_random_numbers_after_a_capture_that_a_host_sync_broke():
    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    with pytest.raises(Exception, match="capture"):
        with capture_graph(torch.cuda.CUDAGraph()):
            (x * 2).sum().item()  # a sync: CUDA invalidates the capture
    assert torch.rand(3, device="cuda").shape == (3,)  # raised "Offset increment outside graph capture" before


def test_the_autotuners_timing_of_a_kernel_that_cannot_be_captured_leaves_random_numbers_usable():
    x = torch.ones(4, device="cuda")
    assert _graphed_median_seconds(lambda inputs: inputs[0].sum().item(), [[x]], x.device, repeats=2) is None
    assert torch.rand(3, device="cuda").shape == (3,)
