"""The pipeline-parallel ops in one process: a rank that sends to itself receives what it sent, the fakes give
the received shapes, dead-code elimination keeps a send, and ``async_transfers`` waits for each micro-batch's
transfers in order. Several processes: ``tests/distributed/test_pipeline_parallel.py``."""

import pytest
import torch
from torch import fx

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops.pipeline_ops import AsyncTransfers, async_transfers

ops = torch.ops.autodeploy


def test_a_rank_sending_to_itself_receives_what_it_sent_in_order():
    first, second = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    ops.pipeline_send(first, 0)
    ops.pipeline_send(second, 0)
    ids = torch.zeros(1, 3, dtype=torch.long)
    got = ops.pipeline_recv(ids, 8, torch.float32, 0, False)
    assert torch.equal(got, first) and got.data_ptr() != first.data_ptr()
    with async_transfers():  # the same inside the asynchronous schedule
        assert torch.equal(ops.pipeline_recv(ids, 8, torch.float32, 0, True), second)
    with pytest.raises(RuntimeError, match="nothing was sent"):
        ops.pipeline_recv(ids, 8, torch.float32, 0, False)
    ops.pipeline_send(first, 0)
    with pytest.raises(RuntimeError, match=r"expected \(1, 3, 4\)"):
        ops.pipeline_recv(ids, 4, torch.float32, 0, False)


def test_fake_receive_is_shaped_like_the_tokens_plus_the_width():
    ids = torch.empty(1, 5, dtype=torch.long, device="meta")
    out = ops.pipeline_recv(ids, 64, torch.bfloat16, 1, False)
    assert out.shape == (1, 5, 64) and out.dtype == torch.bfloat16 and out.is_meta
    assert ops.pipeline_send(torch.empty(1, 5, 64, device="meta"), 1) is None


def test_dead_code_elimination_keeps_a_send():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(ops.pipeline_send.default, (x, 1))
    graph.output(x)
    graph.eliminate_dead_code()
    assert any(n.target is ops.pipeline_send.default for n in graph.nodes)


class _Work:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(self.name)


def test_async_transfers_wait_for_micro_batches_in_order_once():
    log, transfers = [], AsyncTransfers()
    for micro_batch in range(3):
        transfers.begin_micro_batch()
        transfers.add(_Work(log, f"send {micro_batch}"), torch.zeros(1))
        transfers.add(_Work(log, f"logits {micro_batch}"), torch.zeros(1))
    transfers.wait(through=0)
    assert log == ["send 0", "logits 0"]
    transfers.wait(through=0)
    transfers.wait()
    assert log == ["send 0", "logits 0", "send 1", "logits 1", "send 2", "logits 2"]
    with async_transfers(), pytest.raises(RuntimeError, match="does not nest"):
        with async_transfers():
            pass
