"""Every canonical op's fake: fake tensors, torch.export with dynamic token dims, and torch.library.opcheck."""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export import Dim
from torch.utils import _pytree as pytree

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

BUILTIN_OPS = {
    "linear", "rms_norm", "add_rms_norm", "layer_norm", "rope", "attention", "gated_mlp", "fused_gated_mlp", "mlp", "moe",
}


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


@dataclass
class Sample:
    """Arguments for one call of ``op``; ``make(n)`` sizes the token dims (batch and/or seq) to ``n``."""

    op: str
    case: str
    make: Callable[[int], tuple]
    dynamic: dict[int, tuple[int, ...]]  # argument index → dims of that tensor that follow n

    @property
    def id(self) -> str:
        return f"{self.op}-{self.case}"


BF16, FP16 = torch.bfloat16, torch.float16

SAMPLES = [
    Sample("linear", "bias", lambda n: (_randn(n, 3, 8), _randn(6, 8), _randn(6)), {0: (0, 1)}),
    Sample("linear", "bf16 no bias", lambda n: (_randn(n, 8, dtype=BF16), _randn(6, 8, dtype=BF16), None), {0: (0,)}),
    Sample("rms_norm", "bf16", lambda n: (_randn(n, 5, 8, dtype=BF16), _randn(8), 1e-6), {0: (0,)}),
    Sample("rms_norm", "non-contiguous x, offset", lambda n: (_randn(8, n).T, _randn(8), 1e-5, 1.0), {0: (0,)}),
    Sample(
        "add_rms_norm",
        "bf16 offset",
        lambda n: (_randn(n, 5, 8, dtype=BF16), _randn(n, 5, 8, dtype=BF16), _randn(8, dtype=BF16), 1e-6, 1.0),
        {0: (0,), 1: (0,)},
    ),
    Sample("add_rms_norm", "non-contiguous x", lambda n: (_randn(8, n).T, _randn(n, 8), _randn(8), 1e-5), {0: (0,), 1: (0,)}),
    Sample("layer_norm", "affine", lambda n: (_randn(n, 8), _randn(8), _randn(8), 1e-5), {0: (0,)}),
    Sample("layer_norm", "fp16 no affine", lambda n: (_randn(n, 2, 8, dtype=FP16), None, None, 1e-6), {0: (0, 1)}),
    Sample(
        "rope",
        "rotate-half, dynamic seq",
        lambda n: (_randn(2, n, 3, 8), _randn(2, n, 8), _randn(2, n, 8), False),
        {0: (1,), 1: (1,), 2: (1,)},
    ),
    Sample(
        "rope",
        "interleaved partial bf16, dynamic batch",
        lambda n: (_randn(n, 4, 2, 10, dtype=BF16), _randn(n, 4, 6), _randn(n, 4, 6), True),
        {0: (0,), 1: (0,), 2: (0,)},
    ),
    Sample(
        "attention",
        "gqa, dynamic seq",
        lambda n: (_randn(2, n, 4, 8), _randn(2, n, 2, 8), _randn(2, n, 2, 6), 0.3),
        {0: (1,), 1: (1,), 2: (1,)},
    ),
    Sample(
        "attention",
        "bf16 mqa window cap sinks, dynamic batch",
        lambda n: (
            _randn(n, 5, 4, 8, dtype=BF16),
            _randn(n, 5, 1, 8, dtype=BF16),
            _randn(n, 5, 1, 8, dtype=BF16),
            0.3,
            2,
            10.0,
            _randn(4),
        ),
        {0: (0,), 1: (0,), 2: (0,)},
    ),
    Sample(
        "gated_mlp",
        "silu",
        lambda n: (_randn(n, 8), _randn(12, 8), _randn(12, 8), _randn(8, 12), "silu"),
        {0: (0,)},
    ),
    Sample(
        "fused_gated_mlp",
        "gelu_tanh bf16",
        lambda n: (_randn(n, 3, 8, dtype=BF16), _randn(24, 8, dtype=BF16), _randn(8, 12, dtype=BF16), "gelu_tanh"),
        {0: (0, 1)},
    ),
    Sample(
        "mlp",
        "gelu_tanh biases",
        lambda n: (_randn(n, 3, 8), _randn(12, 8), _randn(12), _randn(8, 12), _randn(8), "gelu_tanh"),
        {0: (0, 1)},
    ),
    Sample(
        "mlp",
        "relu no bias",
        lambda n: (_randn(n, 8), _randn(12, 8), None, _randn(8, 12), None, "relu"),
        {0: (0,)},
    ),
    Sample(
        "moe",
        "softmax top-2",
        lambda n: (_randn(n, 8), _randn(n, 4), _randn(4, 12, 8), _randn(4, 8, 6), 2),
        {0: (0,), 1: (0,)},
    ),
    Sample(
        "moe",
        "bf16 sigmoid all experts gelu",
        lambda n: (
            _randn(n, 8, dtype=BF16),
            _randn(n, 4, dtype=BF16),
            _randn(4, 12, 8, dtype=BF16),
            _randn(4, 8, 6, dtype=BF16),
            4,
            "sigmoid",
            False,
            "gelu",
        ),
        {0: (0,), 1: (0,)},
    ),
]


def _op(name: str):
    return getattr(torch.ops.autodeploy, name)


def test_every_builtin_op_has_samples():
    assert {sample.op for sample in SAMPLES} == BUILTIN_OPS


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.id)
def test_fake_gives_the_reference_output_metadata(sample):
    torch.manual_seed(0)
    args = sample.make(3)
    real = _op(sample.op)(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = _op(sample.op)(*fake_args)
    real_outputs, fake_outputs = pytree.tree_leaves(real), pytree.tree_leaves(fake)
    assert len(fake_outputs) == len(real_outputs) and all(isinstance(f, FakeTensor) for f in fake_outputs)
    for f, r in zip(fake_outputs, real_outputs):
        assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride())


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.id)
def test_opcheck(sample):
    torch.manual_seed(0)
    torch.library.opcheck(_op(sample.op), sample.make(3))


class CallOp(torch.nn.Module):
    """Calls one op with the sample's non-tensor arguments fixed and its tensors as inputs."""

    def __init__(self, op: str, args: tuple):
        super().__init__()
        self.op = op
        self.template = args

    def forward(self, *tensors):
        remaining = iter(tensors)
        args = [next(remaining) if isinstance(a, torch.Tensor) else a for a in self.template]
        return _op(self.op)(*args)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.id)
def test_export_keeps_token_dims_symbolic(sample):
    torch.manual_seed(0)
    args = sample.make(3)
    tensor_indices = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    dynamic_shapes = tuple({dim: Dim.DYNAMIC for dim in sample.dynamic.get(i, ())} or None for i in tensor_indices)
    tensors = tuple(args[i] for i in tensor_indices)
    program = torch.export.export(CallOp(sample.op, args), tensors, dynamic_shapes=(dynamic_shapes,))

    (node,) = [n for n in program.graph.nodes if n.target is _op(sample.op).default]
    assert all(any(isinstance(size, torch.SymInt) for size in value.shape) for value in pytree.tree_leaves(node.meta["val"]))

    bigger = sample.make(5)
    out = program.module()(*(bigger[i] for i in tensor_indices))
    torch.testing.assert_close(out, _op(sample.op)(*bigger))
