"""The registry of canonical ops: one call turns a reference and a fake into ``torch.ops.autodeploy.<name>``.

Every canonical op, built in or a user's, goes through :func:`register_op`. The registry keeps, per op,
its reference (the correctness oracle), its fake (shapes and dtypes for export and shape propagation)
and the backend kernels offered for it; a backend is only a candidate that the ``select`` stage and the
autotuner may pick.

Example::

    import torch
    from autodeploy.custom_ops import register_op, canonical_ops

    def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.tanh(x.float() * scale).to(x.dtype)

    def scaled_tanh_fake(x, scale):
        return torch.empty_like(x)

    register_op("scaled_tanh", scaled_tanh, scaled_tanh_fake, example_inputs=(torch.ones(2, 3), 0.5))
    torch.ops.autodeploy.scaled_tanh(torch.randn(4), 2.0)
    assert "scaled_tanh" in canonical_ops()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

NAMESPACE = "autodeploy"


class OpRegistrationError(ValueError):
    """A canonical op or backend could not be registered (duplicate name, unknown op, fake ≠ reference)."""


@dataclass
class Backend:
    """A candidate kernel for a canonical op; it takes the op's arguments and returns what the reference does."""

    name: str
    fn: Callable[..., Any]


@dataclass
class CanonicalOp:
    """What the registry knows about one op. ``op`` is the overload FX graphs hold as ``node.target``."""

    name: str
    op: torch._ops.OpOverload
    reference: Callable[..., Any]
    fake: Callable[..., Any]
    schema: str
    doc: str
    backends: list[Backend] = field(default_factory=list)


_REGISTRY: dict[str, CanonicalOp] = {}


def register_op(
    name: str,
    reference: Callable[..., Any],
    fake: Callable[..., Any],
    *,
    example_inputs: Sequence[Any],
    schema: str | None = None,
    mutates_args: Sequence[str] = (),
) -> Callable[..., Any]:
    """Register ``torch.ops.autodeploy.<name>`` and record it as a canonical op; returns the callable op.

    ``reference`` is the plain-PyTorch implementation; its type hints give the op's schema unless
    ``schema`` (e.g. ``"(Tensor x, float scale) -> Tensor"``) is passed; ``mutates_args`` names the
    arguments it writes in place (the KV caches of ``cached_attention``). ``fake`` computes output shapes
    and dtypes only. Before anything is registered, the reference runs on ``example_inputs`` and the fake
    on meta-device copies of them; a fake whose outputs differ in structure, shape or dtype is rejected.
    Raises :class:`OpRegistrationError` for an invalid or taken name or a fake that disagrees.
    """
    if not name.isidentifier():
        raise OpRegistrationError(f"op name {name!r} is not a Python identifier; use letters, digits and '_'.")
    if hasattr(getattr(torch.ops, NAMESPACE), name):  # ours, or taken by a plain torch.library op
        raise OpRegistrationError(
            f"torch.ops.{NAMESPACE}.{name} is already registered; choose another name "
            f"(a canonical op's contract cannot be replaced, only given more backends via add_backend)."
        )
    _check_fake_matches_reference(name, reference, fake, tuple(example_inputs))

    custom_op = torch.library.custom_op(f"{NAMESPACE}::{name}", reference, mutates_args=tuple(mutates_args), schema=schema)
    custom_op.register_fake(fake)
    overload = getattr(getattr(torch.ops, NAMESPACE), name).default
    _REGISTRY[name] = CanonicalOp(
        name=name,
        op=overload,
        reference=reference,
        fake=fake,
        schema=str(overload._schema),
        doc=reference.__doc__ or "",
    )
    return custom_op


def canonical_ops() -> dict[str, CanonicalOp]:
    """Every registered canonical op by name (a new dict; the records themselves are shared)."""
    return dict(_REGISTRY)


def add_backend(op_name: str, backend_name: str, fn: Callable[..., Any]) -> None:
    """Offer ``fn`` as a candidate kernel for ``op_name``; the autotuner later decides whether it is used."""
    if op_name not in _REGISTRY:
        raise OpRegistrationError(f"unknown canonical op {op_name!r}; registered ops: {sorted(_REGISTRY)}.")
    backends = _REGISTRY[op_name].backends
    if any(backend.name == backend_name for backend in backends):
        raise OpRegistrationError(f"op {op_name!r} already has a backend named {backend_name!r}; choose another name.")
    backends.append(Backend(backend_name, fn))


def _check_fake_matches_reference(
    name: str, reference: Callable[..., Any], fake: Callable[..., Any], example_inputs: tuple[Any, ...]
) -> None:
    # Meta tensors carry shape and dtype without data, which is all a fake may look at; unlike
    # FakeTensorMode they need no torch._dynamo import, so registering the built-in ops stays cheap.
    meta_inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), example_inputs)
    try:
        expected = reference(*example_inputs)
    except Exception as error:
        raise OpRegistrationError(f"reference of {name!r} failed on the example inputs: {error}") from error
    try:
        got = fake(*meta_inputs)
    except Exception as error:
        raise OpRegistrationError(
            f"fake of {name!r} failed on meta copies of the example inputs: {error}. "
            f"A fake may read only shapes, dtypes and arguments, never tensor data."
        ) from error

    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    got_leaves, got_spec = pytree.tree_flatten(got)
    if expected_spec != got_spec:
        raise OpRegistrationError(
            f"fake of {name!r} returns {got_spec} but the reference returns {expected_spec}."
        )
    for index, (want, have) in enumerate(zip(expected_leaves, got_leaves)):
        if isinstance(want, torch.Tensor) != isinstance(have, torch.Tensor):
            raise OpRegistrationError(
                f"fake of {name!r} returns {type(have).__name__} as output {index}; "
                f"the reference returns {type(want).__name__}."
            )
        if isinstance(want, torch.Tensor) and (want.shape != have.shape or want.dtype != have.dtype):
            raise OpRegistrationError(
                f"fake of {name!r} disagrees with the reference on output {index}: fake gives "
                f"{tuple(have.shape)} {have.dtype}, reference gives {tuple(want.shape)} {want.dtype}."
            )
