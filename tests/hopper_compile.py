"""Compile, for a Hopper GPU and without one, every Triton kernel launch a CPU test makes in the interpreter.

Triton's interpreter runs a kernel's Python body on NumPy: it accepts code that the GPU compiler rejects (a
branch that reads a ``None`` pointer the interpreter never reaches, mismatched types across an if/else),
which then fails only on the GPU, at build. The compiler itself needs no GPU: Triton lowers a kernel to a
cubin for ``sm_90`` on this machine. :func:`recorded_launches` notes each launch's arguments as types
(tensors as pointer types, host tensor descriptors as Triton names them, ``None`` and ``tl.constexpr``
parameters as constants) and its launch options;
:func:`compile_for_hopper` compiles each distinct one in a child process without ``TRITON_INTERPRET``
(where ``triton.jit`` makes compilable kernels) and returns the failures.

    with recorded_launches() as launches:
        run_some_kernels_in_the_interpreter()
    assert compile_for_hopper(launches) == []

``tests/conftest.py`` records every launch of a CPU test session and fails the session when one of them
does not compile (a run of a few tests compiles only their launches).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import torch

_POINTER_TYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl")


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    annotation = parameter.annotation
    return "constexpr" in (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""))


def _scalar_type(value: object) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton argument type for {type(value).__name__} {value!r}")


def describe_launch(fn, args: tuple, kwargs: dict) -> dict:
    """A launch as JSON: the kernel's module and name, each argument's Triton type, constants, options."""
    options = {name: kwargs.pop(name) for name in _LAUNCH_OPTIONS if name in kwargs}
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constants = {}, {}
    for name, parameter in inspect.signature(fn).parameters.items():
        value = bound.arguments[name]
        if _is_constexpr(parameter) or value is None:
            signature[name] = "constexpr"
            constants[name] = value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _POINTER_TYPES[value.dtype]
        elif type(value).__name__ == "TensorDescriptor":  # a host-side TMA descriptor: Triton's own type string
            from triton.runtime.jit import mangle_type

            signature[name] = mangle_type(value)
        else:
            signature[name] = _scalar_type(value)
    if "USE_PDL" in constants:  # the interpreter launches without dependent launch; a Hopper launch with it
        constants["USE_PDL"], options["launch_pdl"] = True, True
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constants": constants,
            "options": options}


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[dict]]:
    """Within the block, every interpreted kernel launch is also appended (once per distinct launch) to
    the yielded list; the kernels still run."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[dict] = []
    seen: set[str] = set()
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launch = describe_launch(self.fn, args, dict(kwargs))
        key = json.dumps(launch, sort_keys=True)
        if key not in seen:
            seen.add(key)
            launches.append(launch)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = original


_COMPILER = r"""
import importlib, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

failures = []
for launch in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    source = ASTSource(fn=kernel, signature=launch["signature"], constexprs=launch["constants"])
    try:
        compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as error:
        failures.append(f"{launch['name']} {launch['constants']}: {type(error).__name__}: {error}"[:2000])
json.dump(failures, sys.stdout)
"""


def compile_for_hopper(launches: list[dict], workers: int = 1, timeout: float = 900) -> list[str]:
    """Compile each launch for ``sm_90`` over ``workers`` child processes; returns one line per launch
    that does not compile."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    shares = [launches[index::workers] for index in range(max(1, workers)) if launches[index::workers]]
    children = [
        subprocess.Popen([sys.executable, "-c", _COMPILER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for _ in shares
    ]
    failures = []
    for child, share in zip(children, shares):
        out, err = child.communicate(json.dumps(share), timeout=timeout)
        if child.returncode != 0:
            raise RuntimeError(f"the Hopper compile process failed:\n{err[-4000:]}")
        failures += json.loads(out)
    return failures
