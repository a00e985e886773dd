"""``torch.ops.autodeploy.embedding_int8``: a token embedding table stored in int8, one scale per row.

``qweight[V, H]`` int8 and ``scale[V]`` float32 are the ``int8_wo`` quantization of the table
(``quantize_weight(QuantScheme("int8_wo"), table)``: each row over its own max |value| / 127), so a
looked-up row is ``qweight[id] · scale[id]``, rounded once to the model's ``dtype``. The table is the
largest weight an untied model keeps in its own dtype under a 4-bit scheme (Llama-3-8B: 1.05 of 5.1 GB);
in int8 it takes half. ``quantize.embedding: int8`` asks for it (``transforms/quantize_linear.py``).

Example::

    import torch
    import autodeploy.custom_ops  # noqa: F401  (registers the ops)
    from autodeploy.custom_ops.quantized_linear import QuantScheme, quantize_weight

    table = torch.randn(10, 4)
    stored = quantize_weight(QuantScheme("int8_wo"), table)
    rows = torch.ops.autodeploy.embedding_int8(torch.tensor([[3, 7]]), stored["qweight"], stored["scale"], torch.float32)
    torch.testing.assert_close(rows[0], table[[3, 7]], atol=float(table.abs().max()) / 127, rtol=0)
"""

import torch
import torch.nn.functional as F

from .registry import register_op


def embedding_int8_reference(input_ids: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``table[input_ids]`` of the dequantized table, in ``dtype``: ``[*input_ids.shape, H]``."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or scale.shape != qweight.shape[:1]:
        raise ValueError(f"embedding_int8: needs qweight int8 [V, H] and scale [V]; got qweight {qweight.dtype} "
                         f"{tuple(qweight.shape)}, scale {tuple(scale.shape)}.")
    rows = F.embedding(input_ids, qweight).to(torch.float32)
    return (rows * F.embedding(input_ids, scale.to(torch.float32)[:, None])).to(dtype)


def _fake(input_ids, qweight, scale, dtype):
    return qweight.new_empty((*input_ids.shape, qweight.shape[1]), dtype=dtype)


embedding_int8 = register_op(
    "embedding_int8", embedding_int8_reference, _fake,
    example_inputs=(torch.tensor([[0, 2]]), torch.tensor([[1, -2], [3, 4], [-127, 127]], dtype=torch.int8),
                    torch.tensor([0.5, 0.25, 0.01]), torch.float32),
)
