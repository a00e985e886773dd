"""register_op / canonical_ops / register_backend: the one-call way to add a canonical op, and its guards."""

import uuid

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autodeploy.custom_ops import OpRegistrationError, candidates, canonical_ops, op_by_target, register_backend, register_op
from autodeploy.custom_ops import registry

# The contract in notes/canonical_ops_spec.md; torch writes `int` arguments as SymInt.
SPEC_SCHEMAS = {
    "linear": "autodeploy::linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "rms_norm": "autodeploy::rms_norm(Tensor x, Tensor weight, float eps, float weight_offset=0.) -> Tensor",
    "add_rms_norm": (
        "autodeploy::add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, float weight_offset=0.) "
        "-> (Tensor, Tensor)"
    ),
    "layer_norm": "autodeploy::layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor",
    "rope": "autodeploy::rope(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor",
    "attention": (
        "autodeploy::attention(Tensor q, Tensor k, Tensor v, float scale, SymInt? sliding_window=None, "
        "float? logit_cap=None, Tensor? sinks=None, float[]? alibi_slopes=None, Tensor? bias=None, Tensor? seq_start=None) -> Tensor"
    ),
    "gated_mlp": (
        "autodeploy::gated_mlp(Tensor x, Tensor gate_weight, Tensor up_weight, Tensor down_weight, str activation) "
        "-> Tensor"
    ),
    "fused_gated_mlp": (
        "autodeploy::fused_gated_mlp(Tensor x, Tensor gate_up_weight, Tensor down_weight, str activation) -> Tensor"
    ),
    "mlp": (
        "autodeploy::mlp(Tensor x, Tensor up_weight, Tensor? up_bias, Tensor down_weight, Tensor? down_bias, "
        "str activation) -> Tensor"
    ),
    "moe": (
        "autodeploy::moe(Tensor x, Tensor router_logits, Tensor gate_up_weight, Tensor down_weight, SymInt top_k, "
        'str scoring="softmax", bool renormalize=True, str activation="silu") -> Tensor'
    ),
}


@pytest.fixture(autouse=True)
def private_registry(monkeypatch):
    """Ops registered by a test leave canonical_ops() as it was (torch keeps them, under unique names)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


@pytest.fixture
def name() -> str:
    return f"user_op_{uuid.uuid4().hex[:8]}"


def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``tanh(x · scale)``, in float32, returned in x's dtype."""
    return torch.tanh(x.float() * scale).to(x.dtype)


def scaled_tanh_fake(x, scale):
    return torch.empty_like(x)


EXAMPLE = (torch.ones(2, 3), 0.5)


def test_builtin_ops_are_listed_with_the_spec_signatures():
    ops = canonical_ops()
    assert {name: ops[name].schema for name in SPEC_SCHEMAS} == SPEC_SCHEMAS
    for name in SPEC_SCHEMAS:
        assert ops[name].op is getattr(torch.ops.autodeploy, name).default
        assert "float32" in ops[name].doc, f"{name}'s docstring should state the precision it computes in"
        assert isinstance(ops[name].backends, list)


def test_a_registered_op_runs_through_torch_ops_and_is_listed(name):
    register_op(name, scaled_tanh, scaled_tanh_fake, example_inputs=EXAMPLE)

    x = torch.randn(4, 5).to(torch.bfloat16)
    out = getattr(torch.ops.autodeploy, name)(x, 2.0)
    torch.testing.assert_close(out, torch.tanh(x.float() * 2.0).to(torch.bfloat16), rtol=0, atol=0)
    with FakeTensorMode() as mode:
        fake_out = getattr(torch.ops.autodeploy, name)(mode.from_tensor(x), 2.0)
    assert (fake_out.shape, fake_out.dtype) == ((4, 5), torch.bfloat16)

    info = canonical_ops()[name]
    assert info.schema == f"autodeploy::{name}(Tensor x, float scale) -> Tensor"
    assert info.reference is scaled_tanh and info.fake is scaled_tanh_fake
    assert info.doc.startswith("``tanh(x · scale)``") and info.backends == []


def test_an_explicit_schema_overrides_type_hints(name):
    def untyped_reference(x, scale):
        return scaled_tanh(x, scale)

    schema = "(Tensor x, float scale) -> Tensor"
    register_op(name, untyped_reference, scaled_tanh_fake, example_inputs=EXAMPLE, schema=schema)
    assert canonical_ops()[name].schema == f"autodeploy::{name}(Tensor x, float scale) -> Tensor"


@pytest.mark.parametrize(
    ("fake", "message"),
    [
        (lambda x, scale: x.new_empty(2, 4), r"fake gives \(2, 4\) torch.float32, reference gives \(2, 3\)"),
        (lambda x, scale: torch.empty_like(x, dtype=torch.float16), r"fake gives \(2, 3\) torch.float16"),
        (lambda x, scale: (torch.empty_like(x),), "fake of '.*' returns"),
        (lambda x, scale: x.shape[0], "returns int as output 0; the reference returns Tensor"),
        (lambda x, scale: torch.full_like(x, x.sum().item()), "never tensor data"),
    ],
    ids=["shape", "dtype", "structure", "not-a-tensor", "reads-data"],
)
def test_a_fake_that_disagrees_with_the_reference_is_rejected_and_nothing_is_registered(name, fake, message):
    with pytest.raises(OpRegistrationError, match=message):
        register_op(name, scaled_tanh, fake, example_inputs=EXAMPLE)
    assert name not in canonical_ops() and not hasattr(torch.ops.autodeploy, name)

    register_op(name, scaled_tanh, scaled_tanh_fake, example_inputs=EXAMPLE)  # the name is still free
    assert name in canonical_ops()


def test_a_reference_that_fails_on_its_examples_is_rejected(name):
    with pytest.raises(OpRegistrationError, match="reference of .* failed on the example inputs"):
        register_op(name, scaled_tanh, scaled_tanh_fake, example_inputs=(torch.ones(2),))


def test_a_duplicate_name_is_rejected(name):
    register_op(name, scaled_tanh, scaled_tanh_fake, example_inputs=EXAMPLE)
    with pytest.raises(OpRegistrationError, match=f"torch.ops.autodeploy.{name} is already registered"):
        register_op(name, scaled_tanh, scaled_tanh_fake, example_inputs=EXAMPLE)
    with pytest.raises(OpRegistrationError, match="already registered"):
        register_op("rms_norm", scaled_tanh, scaled_tanh_fake, example_inputs=EXAMPLE)
    assert canonical_ops()["rms_norm"].reference is not scaled_tanh


def test_a_name_taken_by_a_plain_torch_library_op_is_rejected(name):
    torch.library.custom_op(f"autodeploy::{name}", scaled_tanh, mutates_args=())
    with pytest.raises(OpRegistrationError, match="already registered"):
        register_op(name, scaled_tanh, scaled_tanh_fake, example_inputs=EXAMPLE)


def test_a_name_that_is_not_an_identifier_is_rejected():
    with pytest.raises(OpRegistrationError, match="not a Python identifier"):
        register_op("my-op", scaled_tanh, scaled_tanh_fake, example_inputs=EXAMPLE)


def test_registration_errors_are_value_errors():
    assert issubclass(OpRegistrationError, ValueError)


def test_a_backend_is_an_op_named_after_its_kernel_with_a_supports_predicate(name):
    register_op(name, scaled_tanh, scaled_tanh_fake, example_inputs=EXAMPLE)

    def fast_scaled_tanh(x, scale):
        return torch.tanh(x * scale)

    def float32_only(x, scale, *, device):
        return x.dtype == torch.float32 or "float32 only"

    op = register_backend(name, "fast", fast_scaled_tanh, supports=float32_only)
    assert op is getattr(torch.ops.autodeploy, f"{name}_fast").default
    torch.testing.assert_close(op(torch.ones(3), 0.5), torch.tanh(torch.ones(3) * 0.5))
    backends = canonical_ops()[name].backends
    assert [(b.name, b.fn, b.op) for b in backends] == [("fast", fast_scaled_tanh, op)]
    assert [b.name for b in candidates(name)] == ["fast", "reference"]
    assert op_by_target(op) == (canonical_ops()[name], "fast")
    meta = torch.empty(2, device="meta")
    assert backends[0].check([meta, 0.5], torch.device("cpu")) is None
    assert backends[0].check([meta.half(), 0.5], torch.device("cpu")) == "float32 only"

    with pytest.raises(OpRegistrationError, match="already has a backend named 'fast'"):
        register_backend(name, "fast", fast_scaled_tanh)
    with pytest.raises(OpRegistrationError, match="unknown canonical op 'no_such_op'"):
        register_backend("no_such_op", "fast", fast_scaled_tanh)
    with pytest.raises(OpRegistrationError, match="other than 'reference'"):
        register_backend(name, "reference", fast_scaled_tanh)


def test_a_backend_runs_through_an_fx_graph_under_its_own_name(name):
    register_op(name, scaled_tanh, scaled_tanh_fake, example_inputs=EXAMPLE)
    op = register_backend(name, "plain", lambda x, scale: torch.tanh(x * scale))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(op, (x, 2.0)))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert f"{name}_plain" in module.code
    torch.testing.assert_close(module(torch.ones(2)), torch.tanh(torch.ones(2) * 2))


def test_arguments_tuple_binds_by_name_and_positional_drops_only_trailing_defaults():
    import inspect

    from autodeploy.custom_ops.cached_attention import CachedAttentionArgs
    from autodeploy.custom_ops.registry import arguments_tuple, positional

    Args = arguments_tuple("Args", inspect.signature(lambda x, window=None, k_scale=1.0, v_scale=1.0: None))
    assert positional(Args(3)) == (3,)
    assert positional(Args(3, v_scale=2.0)) == (3, None, 1.0, 2.0)  # a default before a given value stays
    assert positional(Args(3, k_scale=1)) == (3, None, 1)  # an int 1 is not the float default: kept
    tensors = [torch.ones(1)] * 10
    call = CachedAttentionArgs(*tensors, 0.5, sinks=torch.zeros(2))
    assert call.scale == 0.5 and call.sliding_window is None and call.k_scale == 1.0
    assert len(positional(call)) == CachedAttentionArgs._fields.index("sinks") + 1
