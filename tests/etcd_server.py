"""A real etcd server for a test: what discovery relies on (leases expiring, state kept across a restart, watch
streams breaking) is etcd's own behaviour, which a fake would only imitate.

    server = EtcdServer(tmp_path, etcd_or_skip())
    registry = EtcdRegistry(server.endpoint)
    server.stop(); server.start()  # the same ports and data dir
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

START_TIMEOUT_S = 20.0


def etcd_or_skip() -> str:
    """The etcd executable. Without one the test is skipped, or fails where ``AUTODEPLOY_REQUIRE_ETCD=1``: CI sets it,
    so a runner without etcd is a broken setup there, never a silent skip."""
    executable = shutil.which("etcd")
    if executable:
        return executable
    missing = "etcd is not installed (Debian: apt install etcd-server)"
    if os.environ.get("AUTODEPLOY_REQUIRE_ETCD") == "1":
        pytest.fail(f"{missing}, and AUTODEPLOY_REQUIRE_ETCD=1 requires it")
    pytest.skip(missing)


class EtcdServer:
    """One etcd member on two free loopback ports (client, peer), data under ``tmp_path / "etcd"``, its output in
    ``tmp_path / "etcd.log"``. Started by the constructor; ``endpoint`` is its client URL."""

    def __init__(self, tmp_path: Path, executable: str | None = None) -> None:
        self.executable = executable or shutil.which("etcd")
        if self.executable is None:
            raise FileNotFoundError("etcd is not installed (Debian: apt install etcd-server)")
        self.client_port, self.peer_port = free_ports(2)
        self.endpoint = f"http://127.0.0.1:{self.client_port}"
        self.data_dir = tmp_path / "etcd"
        self.log_path = tmp_path / "etcd.log"
        self._process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Run etcd (again: the same ports and data dir) and return once it answers as healthy."""
        peer = f"http://127.0.0.1:{self.peer_port}"
        command = [self.executable, "--name", "default", "--data-dir", str(self.data_dir),
                   "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                   "--initial-cluster", f"default={peer}"]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self._wait_until_healthy()

    def stop(self) -> None:
        """SIGTERM, and wait for it to exit (SIGKILL after 10 s)."""
        if self._process is None or self._process.poll() is not None:
            return
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"etcd exited with status {self._process.returncode}; the end of "
                                   f"{self.log_path}:\n{self._log_tail()}")
            if self._answers_healthy():
                return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"etcd did not answer at {self.endpoint} within {START_TIMEOUT_S:g} s; the end of "
                           f"{self.log_path}:\n{self._log_tail()}")

    def _answers_healthy(self) -> bool:
        # /health says true once the member has a leader, i.e. can take writes.
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as response:
                return json.load(response).get("health") == "true"
        except (OSError, ValueError):
            return False

    def _log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def free_ports(count: int) -> list[int]:
    """Ports the kernel picks as free, all held open together so they differ."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for held in sockets:
            held.bind(("127.0.0.1", 0))
        return [held.getsockname()[1] for held in sockets]
    finally:
        for held in sockets:
            held.close()
