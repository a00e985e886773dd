"""``autodeploy serve`` checks its address before it builds anything: a port out of range, taken, or an address this
machine does not have is one clean error line; the socket it bound is the one uvicorn serves on."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import autodeploy
import autodeploy.serve
from autodeploy.cli.main import main


@pytest.fixture
def no_build(monkeypatch):
    def build(*args, **kwargs):
        raise AssertionError("the engine was built before the address was checked")

    monkeypatch.setattr(autodeploy, "autodeploy", build)


def serve_error(capsys, *argv) -> str:
    code = main(["serve", *argv])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_a_port_out_of_range_is_refused_before_the_build(capsys, no_build, port):
    assert f"--port {port} is not a TCP port (0 to 65535)" in serve_error(capsys, "--port", port)


def test_a_port_in_use_is_refused_before_the_build(capsys, no_build):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        err = serve_error(capsys, "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use); choose another --port" in err


@pytest.mark.skipif(Path("/proc/sys/net/ipv4/ip_nonlocal_bind").exists()
                    and Path("/proc/sys/net/ipv4/ip_nonlocal_bind").read_text().strip() == "1",
                    reason="this machine lets a socket bind any address")
def test_an_address_this_machine_does_not_have_is_refused_before_the_build(capsys, no_build):
    err = serve_error(capsys, "--host", "203.0.113.7", "--port", "8000")  # TEST-NET-3: never a local address
    assert "cannot listen on 203.0.113.7:8000 (Cannot assign requested address); choose another --port or --host" in err


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_uvicorn_serves_on_the_socket_bound_before_the_build(monkeypatch, llama_llm):
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    free_at_build, served = [], {}
    monkeypatch.setattr(autodeploy, "autodeploy", lambda *args, **kwargs: free_at_build.append(port_is_free(port)) or llama_llm)

    def run_server(app, host, port, log_level, sock):
        served["address"] = sock.getsockname()
        sock.close()  # as uvicorn does when it stops

    monkeypatch.setattr(autodeploy.serve, "run_server", run_server)
    assert main(["serve", "--port", str(port)]) == 0
    assert free_at_build == [False] and served == {"address": ("127.0.0.1", port)} and port_is_free(port)
