"""Start the ``tritonserver`` that the ``nvidia-pytriton`` wheel bundles on a model repository, with its
Python backend running this Python environment (the one with autodeploy, torch and the wheel installed):

    .venv-triton/bin/python -m autodeploy.serve.triton.launch triton-repo --http-port 8000 --grpc-port 8001 --metrics-port 8002

What it takes (found out with the wheel, 0.7.0 = Triton 2.51):
- The wheel keeps one Python-backend stub a Python minor version (``python_backend_stubs/3.X``) and none in
  ``backends/python``; the server looks for ``triton_python_backend_stub`` there, so this module assembles a
  backend folder (the backend library, its utils module and this interpreter's stub) inside the environment.
- The stub links ``libpython3.X.so``: ``LD_LIBRARY_PATH`` starts with this interpreter's LIBDIR (else the
  loader may pick a system libpython of another build), then the wheel's ``nvidia_pytriton.libs``.
- The stub embeds Python, which finds its prefix by looking up ``python3`` on ``PATH``: with this
  environment's ``bin`` first it starts in this environment (its ``pyvenv.cfg``, its site-packages).
- The stub's Python is isolated (it ignores ``PYTHON*`` variables) and stays in the C locale, where
  ``open()`` reads ASCII and torch's inductor templates fail to import; each ``model.py`` therefore takes
  the environment's locale first, and this sets a UTF-8 one when the environment has none.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from autodeploy.errors import ConfigError


def tritonserver_command(repository: str | Path, http_port: int, grpc_port: int, metrics_port: int,
                         host: str = "127.0.0.1", extra: list[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The ``tritonserver`` command line and environment that serve ``repository`` from this interpreter."""
    wheel = _pytriton_directory()
    server = wheel / "tritonserver"
    libdir = sysconfig.get_config_var("LIBDIR")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not libdir:
        raise ConfigError(f"the Python backend stub links libpython{sys.version_info.major}.{sys.version_info.minor}.so, "
                          f"and {sys.executable} was built without it (--enable-shared); use a shared-library build of Python")
    backends = _backend_directory(server)
    environment = dict(os.environ)
    environment["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{environment.get('PATH', '')}"
    libraries = [libdir, str(wheel.parent / "nvidia_pytriton.libs"), environment.get("LD_LIBRARY_PATH", "")]
    environment["LD_LIBRARY_PATH"] = os.pathsep.join(path for path in libraries if path)
    if not any("utf" in environment.get(name, "").lower() for name in ("LC_ALL", "LC_CTYPE", "LANG")):
        environment["LC_ALL"] = "C.UTF-8"
    command = [
        str(server / "bin" / "tritonserver"),
        f"--model-repository={Path(repository).resolve()}",
        f"--backend-directory={backends}",
        f"--http-address={host}", f"--http-port={http_port}",
        f"--grpc-address={host}", f"--grpc-port={grpc_port}",
        f"--metrics-address={host}", f"--metrics-port={metrics_port}",
        "--allow-gpu-metrics=false",
        *extra,
    ]
    return command, environment


def _pytriton_directory() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise ConfigError(f"nvidia-pytriton is not installed in {sys.prefix}; it bundles tritonserver: pip install nvidia-pytriton "
                          "(make .venv-triton/.installed builds an environment with it)")
    return Path(spec.origin).parent


def _backend_directory(server: Path) -> Path:
    """``backends/python`` with this interpreter's stub, assembled once per environment."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ConfigError(f"the pytriton wheel has no Python backend stub for Python {version} ({stub}); use a Python it has one for")
    backends = Path(sys.prefix) / "autodeploy-triton-backends"
    if not (backends / "python" / stub.name).is_file():
        staging = Path(tempfile.mkdtemp(dir=sys.prefix, prefix=".autodeploy-triton-backends-"))
        (staging / "python").mkdir()
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy2(server / "backends" / "python" / name, staging / "python" / name)
        shutil.copy2(stub, staging / "python" / stub.name)
        try:
            staging.rename(backends)  # whole or not at all, should two launches assemble it at once
        except OSError:
            shutil.rmtree(staging)
    return backends


@dataclass(frozen=True)
class Endpoints:
    http: str  # http://127.0.0.1:PORT
    grpc: str  # 127.0.0.1:PORT (tritonclient.grpc's form)
    metrics: str  # http://127.0.0.1:PORT/metrics


@contextlib.contextmanager
def running_server(python: str | Path, repository: str | Path, log_path: str | Path, startup_timeout_s: float = 300) -> Iterator[Endpoints]:
    """tritonserver on ``repository`` on free loopback ports, launched by ``python`` (an interpreter with
    autodeploy and nvidia-pytriton, e.g. ``.venv-triton/bin/python``) with one torch thread; yields its
    endpoints once it is ready and stops it on exit. Its output goes to ``log_path``, whose tail a
    ``RuntimeError`` carries when it does not start."""
    http, grpc, metrics = _free_ports(3)
    with open(log_path, "w") as log:
        process = subprocess.Popen([str(python), "-m", "autodeploy.serve.triton.launch", str(repository), f"--http-port={http}",
                                    f"--grpc-port={grpc}", f"--metrics-port={metrics}"],
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not _ready(f"http://127.0.0.1:{http}/v2/health/ready"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tritonserver did not start (exit code {process.poll()}):\n{Path(log_path).read_text()[-4000:]}")
            time.sleep(0.5)
        yield Endpoints(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics")
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:  # all bound at once, so the ports differ
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m autodeploy.serve.triton.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("repository", help="the model repository (autodeploy triton-repo MODEL --out DIR)")
    parser.add_argument("--host", default="127.0.0.1", help="address of all three endpoints (default loopback)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    args, extra = parser.parse_known_args(argv)  # anything else goes to tritonserver (e.g. --log-verbose=1)
    try:
        command, environment = tritonserver_command(args.repository, args.http_port, args.grpc_port, args.metrics_port, args.host, extra)
    except ConfigError as error:
        sys.exit(f"error: {error}")
    os.execve(command[0], command, environment)


if __name__ == "__main__":
    main()
