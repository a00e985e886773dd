"""The registry of canonical ops: one call turns a reference and a fake into ``torch.ops.autodeploy.<name>``.

Every canonical op, built in or a user's, goes through :func:`register_op`. The registry keeps, per op,
its reference (the correctness oracle), its fake (shapes and dtypes for export and shape propagation)
and the backend kernels offered for it. A backend is itself an op, ``torch.ops.autodeploy.<op>_<backend>``
(:func:`register_backend`), so graphs, reports and profiler traces name the kernel; it is only a
candidate until the ``select`` stage (and the autotuner) retarget a node to it, where its ``supports``
predicate admits the node's arguments and device.

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

    # A faster kernel for it, on float32 only: select may now retarget nodes to torch.ops.autodeploy.scaled_tanh_fast.
    register_backend("scaled_tanh", "fast", lambda x, scale: torch.tanh(x * scale),
                     supports=lambda x, scale, *, device: x.dtype == torch.float32 or "float32 only")
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

NAMESPACE = "autodeploy"
REFERENCE = "reference"  # the backend name of an op's own reference implementation

# Backends are defined through a plain library fragment rather than torch.library.custom_op: a call
# then goes from the dispatcher straight to the kernel, without custom_op's autograd and
# argument-checking wrappers (about a quarter of the per-call overhead on the CPU, measured).
_BACKEND_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")

Supports = Callable[..., Any]


class OpRegistrationError(ValueError):
    """A canonical op or backend could not be registered (duplicate name, unknown op, fake ≠ reference)."""


def supports_any(*args: Any, device: torch.device) -> bool:
    """The ``supports`` predicate of a backend that runs every node on every device."""
    return True


@dataclass
class Backend:
    """A candidate kernel for a canonical op: ``op`` (``torch.ops.autodeploy.<op>_<name>``) takes the op's
    arguments and returns what the reference does.

    ``supports(*args, device=...)`` is called with the node's arguments, tensors as meta tensors (shape,
    dtype, strides; no data), and the device the deploy runs on. It returns ``True`` when the backend
    can run that node, otherwise ``False`` or a string saying why not (shown in reports and errors).
    """

    name: str
    fn: Callable[..., Any]
    op: Any = None  # the OpOverload graphs hold after select; the reference's is the canonical op itself
    supports: Supports = supports_any
    # False when a call reads device tensors on the host (.tolist(), data-dependent shapes): that syncs,
    # which CUDA graph capture forbids, so the compile stage keeps a graph with such a kernel eager.
    capturable: bool = True
    # True for a backend only asked-for selects (``batch_invariant``, a ``backends`` preference): the autotuner's
    # contest and the first-supported rule pass it by (``custom_ops/batch_invariant.py``'s, slower by design).
    opt_in: bool = False

    def check(self, args: Sequence[Any], device: torch.device) -> str | None:
        """``None`` when this backend supports the node, else the reason it does not."""
        try:
            verdict = self.supports(*args, device=device)
        except Exception as error:  # a predicate that cannot read these arguments does not support them
            return f"its supports() raised {type(error).__name__}: {error}"
        if verdict is True:
            return None
        return verdict if isinstance(verdict, str) and verdict else "not supported for these arguments"


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
    reference_capturable: bool = True  # see Backend.capturable
    # Integer arguments the autotuner may synthesize, by name: ``make(num_tokens, device)`` → a valid value for a
    # problem of that many tokens (``register_tuning_input``). An op with integer inputs and none of these is not tuned.
    tuning_inputs: dict[str, Callable[[int, torch.device], torch.Tensor]] = field(default_factory=dict)


_REGISTRY: dict[str, CanonicalOp] = {}


def register_op(
    name: str,
    reference: Callable[..., Any],
    fake: Callable[..., Any],
    *,
    example_inputs: Sequence[Any],
    schema: str | None = None,
    mutates_args: Sequence[str] = (),
    capturable: bool = True,
) -> Callable[..., Any]:
    """Register ``torch.ops.autodeploy.<name>`` and record it as a canonical op; returns the callable op.

    ``reference`` is the plain-PyTorch implementation; its type hints give the op's schema unless
    ``schema`` (e.g. ``"(Tensor x, float scale) -> Tensor"``) is passed; ``mutates_args`` names the
    arguments it writes in place (the KV caches of ``cached_attention``); ``capturable=False`` says the
    reference reads device tensors on the host (see :class:`Backend`). ``fake`` computes output shapes
    and dtypes only. Before anything is registered, the reference runs on ``example_inputs`` and the fake
    on meta-device copies of them; a fake whose outputs differ in structure, shape or dtype is rejected.
    Raises :class:`OpRegistrationError` for an invalid or taken name or a fake that disagrees.
    """
    if not name.isidentifier():
        raise OpRegistrationError(f"op name {name!r} is not a Python identifier; use letters, digits and '_'.")
    if hasattr(getattr(torch.ops, NAMESPACE), name):  # ours, or taken by a plain torch.library op
        raise OpRegistrationError(
            f"torch.ops.{NAMESPACE}.{name} is already registered; choose another name "
            f"(a canonical op's contract cannot be replaced, only given more backends via register_backend)."
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
        reference_capturable=capturable,
    )
    return custom_op


def arguments_tuple(name: str, signature: inspect.Signature) -> type:
    """A namedtuple of ``signature``'s parameters in order, with its defaults: ``Args(*args, **kwargs)`` binds one
    call's arguments by name, so an op's fake, backends and graph rewrites need not restate a long signature.

    >>> Args = arguments_tuple("Args", inspect.signature(lambda x, scale=1.0: None))
    >>> Args(2).scale
    1.0
    """
    parameters = list(signature.parameters.values())
    defaults = [p.default for p in parameters if p.default is not inspect.Parameter.empty]
    return collections.namedtuple(name, [p.name for p in parameters], defaults=defaults)


def positional(call: tuple) -> tuple:
    """``call``'s values as a node's positional arguments, without the trailing ones that equal their default (a
    graph then reads as it would had they been left out)."""
    values, defaults = list(call), type(call)._field_defaults
    while values and _is_default(values[-1], defaults.get(call._fields[len(values) - 1], inspect.Parameter.empty)):
        values.pop()
    return tuple(values)


def _is_default(value: Any, default: Any) -> bool:
    # Only plain values compare: a graph node or a tensor equals no default.
    return value is default or (type(value) is type(default) in (int, float, bool, str) and value == default)


def op_by_target(target: Any) -> tuple[CanonicalOp, str] | None:
    """``(canonical op, backend name)`` for a node target that is a canonical op or one of its backends."""
    for record in _REGISTRY.values():
        if target is record.op:
            return record, REFERENCE
        for backend in record.backends:
            if target is backend.op:
                return record, backend.name
    return None


def canonical_ops() -> dict[str, CanonicalOp]:
    """Every registered canonical op by name (a new dict; the records themselves are shared)."""
    return dict(_REGISTRY)


def register_backend(
    op_name: str, backend_name: str, fn: Callable[..., Any], *, supports: Supports = supports_any,
    capturable: bool = True, opt_in: bool = False,
) -> Any:
    """Register ``fn`` as ``torch.ops.autodeploy.<op_name>_<backend_name>``, a candidate kernel for ``op_name``.

    ``fn`` takes the canonical op's arguments and returns what its reference does (the op's schema and
    fake are reused). ``supports(*args, device=...)`` admits the nodes it can run (see :class:`Backend`);
    the default admits all; ``capturable=False`` marks a kernel that syncs with the host, ``opt_in=True``
    one that only a request selects (see :class:`Backend`). The backend then joins kernel selection and the autotuner's contest with no
    other change. Returns the new op's overload. Raises :class:`OpRegistrationError` for an unknown op,
    a taken backend name or a name that is not an identifier.
    """
    if op_name not in _REGISTRY:
        raise OpRegistrationError(f"unknown canonical op {op_name!r}; registered ops: {', '.join(sorted(_REGISTRY))}.")
    record = _REGISTRY[op_name]
    if not backend_name.isidentifier() or backend_name == REFERENCE:
        raise OpRegistrationError(
            f"backend name {backend_name!r} of op {op_name!r} must be a Python identifier other than {REFERENCE!r}."
        )
    if any(backend.name == backend_name for backend in record.backends):
        raise OpRegistrationError(f"op {op_name!r} already has a backend named {backend_name!r}; choose another name.")
    qualified = f"{op_name}_{backend_name}"
    if hasattr(getattr(torch.ops, NAMESPACE), qualified):
        raise OpRegistrationError(f"torch.ops.{NAMESPACE}.{qualified} is already registered; choose another backend name.")
    arguments = record.schema[record.schema.index("(") :]  # "(Tensor x, …) -> Tensor", mutation marks included
    _BACKEND_LIBRARY.define(qualified + arguments)
    _BACKEND_LIBRARY.impl(qualified, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{qualified}", record.fake, lib=_BACKEND_LIBRARY)
    overload = getattr(getattr(torch.ops, NAMESPACE), qualified).default
    record.backends.append(Backend(backend_name, fn, overload, supports, capturable, opt_in))
    return overload


def register_tuning_input(op_name: str, argument: str, make: Callable[[int, torch.device], torch.Tensor]) -> None:
    """Let the autotuner time ``op_name``'s nodes that take the integer tensor ``argument`` (sequence metadata, which
    random numbers would make invalid): ``make(num_tokens, device)`` returns a representative valid value for a
    problem of ``num_tokens`` tokens. Raises :class:`OpRegistrationError` for an unknown op or argument.

    >>> register_tuning_input("attention", "seq_start",  # one text of all the tokens  # doctest: +SKIP
    ...                       lambda tokens, device: torch.tensor([0, tokens], dtype=torch.int32, device=device))
    """
    if op_name not in _REGISTRY:
        raise OpRegistrationError(f"unknown canonical op {op_name!r}; registered ops: {', '.join(sorted(_REGISTRY))}.")
    record = _REGISTRY[op_name]
    names = [a.name for a in record.op._schema.arguments]
    if argument not in names:
        raise OpRegistrationError(f"op {op_name!r} has no argument {argument!r}; its arguments: {', '.join(names)}.")
    record.tuning_inputs[argument] = make


def candidates(op_name: str) -> list[Backend]:
    """The op's backends in registration order, then its reference (the backend of last resort)."""
    record = _REGISTRY[op_name]
    return [*record.backends, Backend(REFERENCE, record.reference, record.op, supports_any, record.reference_capturable)]


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
