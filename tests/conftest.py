"""Shared fixtures: tiny checkpoints written once per session, one deployed tiny Llama, an offline hub, a guard that a
reload builds nothing.

The tiny checkpoints are deterministic (``tests/tiny_models.py``, seed 0), so a test can rebuild the
matching HF reference model with ``tiny_hf_model(arch)`` instead of keeping one alive per checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads this when a
# function is decorated with triton.jit (its own library included, which transformers may import),
# so it is set before anything else is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # pytest workers share the GPU: small KV pools (see the file)
    os.environ.setdefault("AUTODEPLOY_CONFIG", str(Path(__file__).with_name("gpu.yaml")))

from tests.tiny_models import write_tiny_checkpoint  # noqa: E402

# Tiny models gain nothing from intra-op threads, and on a shared 2-core runner a second thread that
# is descheduled stalls every op at its barrier (measured: 4-token generate 10 ms → 1 s under load).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """``tiny_checkpoint("llama")`` → folder with config.json, model.safetensors and tokenizer files.

    Each (arch, max_shard_size) is written once per session; treat the folder as read-only
    (copy it with ``shutil.copytree`` before editing).
    """
    written: dict[tuple[str, str | None], Path] = {}

    def get(arch: str, max_shard_size: str | None = None) -> Path:
        key = (arch, max_shard_size)
        if key not in written:
            suffix = f"-sharded-{max_shard_size}" if max_shard_size else ""
            directory = tmp_path_factory.mktemp(f"tiny-{arch}{suffix}")
            write_tiny_checkpoint(arch, directory, max_shard_size=max_shard_size)
            written[key] = directory
        return written[key]

    return get


@pytest.fixture(scope="session")
def llama_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def llama_llm(llama_dir):
    """The tiny Llama deployed on CPU with the default pipeline; shared, so do not mutate it."""
    from autodeploy import autodeploy

    return autodeploy(str(llama_dir), device="cpu")


@pytest.fixture(scope="session")
def gpu_llama_llm(llama_dir):
    """The tiny Llama on the GPU, float32 (so a free request's tokens do not depend on the batch it shares) and a
    small KV pool (pytest workers share the GPU); shared, so do not mutate it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from autodeploy import autodeploy

    return autodeploy(str(llama_dir), device="cuda", dtype="float32", kv_cache={"num_blocks": 64})


@pytest.fixture
def forbid_building(monkeypatch):
    """Call it, and from then on any export, pipeline run or verification fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a reload must not export, run transforms or verify")

    def forbid():
        for target in ("torch.export.export", "autodeploy.pipeline.Pipeline.run", "autodeploy.api.build_verified"):
            monkeypatch.setattr(target, refuse)

    return forbid


@pytest.fixture
def hf_offline(monkeypatch, tmp_path) -> Path:
    """Hub look-ups see only an empty local cache (returned) and never the network.

    huggingface_hub parses HF_HUB_OFFLINE and HF_HUB_CACHE once, at import, so the parsed
    constants are patched as well as the environment (which subprocesses inherit).
    """
    import huggingface_hub.constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


# Every Triton launch of a CPU session, compiled for Hopper once the tests are done (tests/hopper_compile.py):
# the interpreter accepts kernels the GPU compiler rejects, and only this finds them before a GPU does.
# Under pytest-xdist each worker records its own launches and hands them to the controller, which compiles
# the union once (a worker's report and exit status would be lost, and both workers make many of the same launches).
_hopper_launches: list[dict] | None = None
_hopper_recording = None
_worker_launches: list[dict] = []  # the controller's: what the workers recorded


def _is_xdist_controller(config) -> bool:
    return config.pluginmanager.hasplugin("dsession")


def pytest_sessionstart(session):
    global _hopper_launches, _hopper_recording
    if os.environ.get("TRITON_INTERPRET") == "1" and not _is_xdist_controller(session.config):
        from tests.hopper_compile import recorded_launches

        _hopper_recording = recorded_launches()
        _hopper_launches = _hopper_recording.__enter__()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """A worker's launches (xdist's hook, on the controller). A worker that crashed (a fatal error in a kernel) has no
    output: its tests are reported failed by xdist, and this hook must not turn that into an INTERNALERROR."""
    output = getattr(node, "workeroutput", None) or {}
    _worker_launches.extend(json.loads(output.get("hopper_launches", "[]")))


def pytest_sessionfinish(session, exitstatus):
    if _hopper_launches is not None:
        _hopper_recording.__exit__(None, None, None)
        if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller compiles
            session.config.workeroutput["hopper_launches"] = json.dumps(_hopper_launches)
            return
        launches = _hopper_launches
    else:
        distinct = {json.dumps(launch, sort_keys=True): launch for launch in _worker_launches}
        launches = list(distinct.values())
    if not launches:
        return
    from tests.hopper_compile import compile_for_hopper

    failures = compile_for_hopper(launches, workers=os.cpu_count() or 1)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reporter.write("\n")  # after the progress line of -q, which ends without one
    if failures:
        reporter.section("Triton kernels that do not compile for Hopper (sm_90)", red=True)
        for failure in failures:
            reporter.write_line(failure)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        reporter.write_line(f"{len(launches)} Triton launches of this session compile for Hopper (sm_90).")


@pytest.fixture(autouse=True)
def _cuda_random_numbers_still_work():
    """A CUDA graph capture that fails can leave CUDA's default generator in capture state, so whatever draws
    random numbers next fails ("Offset increment outside graph capture"), far from the cause: name the test
    that left it so."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.rand(1, device="cuda")
        except RuntimeError as error:
            pytest.fail(f"this test left CUDA's random number generator unusable: {error}")


@pytest.fixture
def interpreter_rounds_to_fp8_correctly():
    """Triton 3.6's interpreter rounds a float to e4m3 half-up on the mantissa and drops the carry into
    the exponent (126.2 → 64, not 128); the GPU's conversion rounds to nearest even. While a test runs,
    down-casts to e4m3 in the interpreter go through torch's conversion, which rounds as the GPU does."""
    if torch.cuda.is_available():
        yield
        return
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def convert_to_e4m3_to_nearest_even(values, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype.primitive_bitwidth <= 8:
            return convert(values, input_dtype, output_dtype, rounding_mode)
        as_float = torch.from_numpy(np.ascontiguousarray(values).astype(np.float32))
        return as_float.to(torch.float8_e4m3fn).view(torch.uint8).numpy()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_convert_float", convert_to_e4m3_to_nearest_even)
        yield
