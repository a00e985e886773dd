"""``embedding_int8``: rows of an int8 table times their scales, against the float64 dequantized table."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops.quantized_linear import QuantScheme, dequantize_weight, quantize_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_the_dequantized_tables_rounded_once_to_the_dtype(dtype):
    table = torch.randn(50, 12) * torch.logspace(-2, 2, 50)[:, None]  # rows of very different ranges
    stored = quantize_weight(QuantScheme("int8_wo"), table)
    ids = torch.randint(0, 50, (3, 7))
    rows = torch.ops.autodeploy.embedding_int8(ids, stored["qweight"], stored["scale"], dtype)
    expected = stored["qweight"].to(torch.float64)[ids] * stored["scale"].to(torch.float64)[ids, None]
    assert rows.shape == (3, 7, 12) and rows.dtype == dtype
    assert torch.equal(rows, expected.to(torch.float32).to(dtype))
    assert torch.equal(rows, dequantize_weight(QuantScheme("int8_wo"), stored).to(dtype)[ids])
    # Each row within half a step of its own range (before bfloat16's own rounding): small rows stay precise.
    rows = torch.ops.autodeploy.embedding_int8(ids, stored["qweight"], stored["scale"], torch.float32)
    assert ((rows.double() - table.double()[ids]).abs() <= table.abs().amax(1).double()[ids, None] / 254 + 1e-6).all()


def test_the_lookup_exports_with_a_symbolic_token_count():
    stored = quantize_weight(QuantScheme("int8_wo"), torch.randn(20, 8))

    class Lookup(torch.nn.Module):
        def forward(self, ids):
            return torch.ops.autodeploy.embedding_int8(ids, stored["qweight"], stored["scale"], torch.bfloat16)

    program = torch.export.export(Lookup(), (torch.zeros(1, 5, dtype=torch.long),), dynamic_shapes=({1: Dim("tokens", min=1)},))
    out = program.module()(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 8) and out.dtype == torch.bfloat16


def test_a_table_that_is_not_int8_rows_with_a_scale_each_is_refused():
    with pytest.raises(ValueError, match=r"embedding_int8: needs qweight int8 \[V, H\] and scale \[V\]"):
        torch.ops.autodeploy.embedding_int8(torch.tensor([0]), torch.zeros(4, 2), torch.ones(4), torch.float32)
