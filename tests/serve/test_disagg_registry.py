"""Discovery in etcd against a real etcd server: workers register, stay listed while they heartbeat, leave at once
when they close and after their ttl when they die; the router's watcher follows, and both outlive an etcd restart.

Leases are short (``ttl_s=2``, etcd's minimum) so expiry is seen in seconds. Tests that leave etcd running share
one server, each under a namespace of its own.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import etcd3gw
import pytest

from autodeploy.serve.disagg.registry import EtcdRegistry, RegistryError, WorkerInfo
from tests.etcd_server import EtcdServer, etcd_or_skip, free_ports

TTL_S = 2.0
REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shared_etcd(tmp_path_factory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd"), etcd_or_skip())
    yield server
    server.stop()


@pytest.fixture
def registry(shared_etcd, request) -> EtcdRegistry:
    return EtcdRegistry(shared_etcd.endpoint, namespace=request.node.name, ttl_s=TTL_S)


def raw_client(server: EtcdServer) -> etcd3gw.Etcd3Client:
    """A client of the test's own, for what a registry does not do (a record no worker wrote, a lease revoked)."""
    return etcd3gw.client(host="127.0.0.1", port=server.client_port, timeout=2)


def worker(worker_id: str, role: str = "decode") -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"http://127.0.0.1:800{worker_id[-1]}", "llama-fp32")


def ids(workers: list[WorkerInfo]) -> list[str]:
    return sorted(info.worker_id for info in workers)


def wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    """Return once ``condition()`` holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not true within {timeout_s} s")
        time.sleep(0.05)


class Lists:
    """What a watcher's on_change received, in order."""

    def __init__(self) -> None:
        self.received: list[list[str]] = []
        self._lock = threading.Lock()

    def __call__(self, workers: list[WorkerInfo]) -> None:
        with self._lock:
            self.received.append(ids(workers))

    def last(self) -> list[str] | None:
        with self._lock:
            return self.received[-1] if self.received else None


@pytest.mark.timeout(60)
def test_two_workers_register_and_both_are_listed(registry, shared_etcd, caplog):
    registry.check()
    prefill = registry.register(worker("p0", "prefill"), load=lambda: {"queued_prompt_tokens": 7})
    decode = registry.register(worker("d1"), load=lambda: {"running": 2})
    raw_client(shared_etcd).put(f"/{registry.namespace}/workers/garbage", "not json")  # skipped: not a record

    with caplog.at_level(logging.WARNING):
        workers = {info.worker_id: info for info in registry.workers()}

    assert workers == {"d1": WorkerInfo("d1", "decode", "http://127.0.0.1:8001", "llama-fp32", {"running": 2}),
                       "p0": WorkerInfo("p0", "prefill", "http://127.0.0.1:8000", "llama-fp32",
                                        {"queued_prompt_tokens": 7})}
    assert "garbage" in caplog.text
    prefill.close()
    decode.close()


@pytest.mark.timeout(60)
def test_heartbeat_keeps_a_registration_past_its_ttl_and_refreshes_its_load(registry):
    beats = iter(range(1000))
    registration = registry.register(worker("d0"), load=lambda: {"running": next(beats)})

    time.sleep(TTL_S * 1.75)

    (listed,) = registry.workers()
    assert listed.worker_id == "d0" and listed.load["running"] >= 2  # re-put every ttl/3 with load()
    registration.close()


@pytest.mark.timeout(60)
def test_closing_a_registration_removes_it_at_once(registry):
    staying = registry.register(worker("d0"), load=dict)
    leaving = registry.register(worker("d1"), load=dict)

    leaving.close()

    assert ids(registry.workers()) == ["d0"]
    staying.close()
    assert registry.workers() == []


@pytest.mark.timeout(60)
def test_a_worker_that_dies_disappears_after_its_ttl(registry):
    """A child process registers and is SIGKILLed: nothing revokes its lease, etcd expires it."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from autodeploy.serve.disagg.registry import EtcdRegistry, WorkerInfo\n"
         "registry = EtcdRegistry(sys.argv[1], namespace=sys.argv[2], ttl_s=float(sys.argv[3]))\n"
         "registry.register(WorkerInfo('d9', 'decode', 'http://127.0.0.1:8009', 'llama-fp32'), load=dict)\n"
         "print('registered', flush=True)\n"
         "time.sleep(60)\n",
         registry.endpoint, registry.namespace, str(TTL_S)],
        cwd=REPOSITORY, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "registered"
        assert ids(registry.workers()) == ["d9"]
        child.send_signal(signal.SIGKILL)
        child.wait()
        killed = time.monotonic()
        wait_for(lambda: registry.workers() == [], timeout_s=TTL_S + 3)
        # Not before its lease ran out: the last heartbeat was at most ttl/3 before the kill.
        assert time.monotonic() - killed > TTL_S * 2 / 3 - 0.25
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(60)
def test_the_watcher_sees_additions_and_removals_as_they_happen(registry):
    lists = Lists()
    watcher = registry.watch(lists, resync_s=30)  # so only the watch stream can report changes in time
    wait_for(lambda: lists.last() == [], timeout_s=2)
    assert watcher.healthy

    first = registry.register(worker("p0", "prefill"), load=dict)
    second = registry.register(worker("d1"), load=dict)
    wait_for(lambda: lists.last() == ["d1", "p0"], timeout_s=3)  # any missed put is followed by a heartbeat's
    first.close()
    wait_for(lambda: lists.last() == ["d1"], timeout_s=2)
    second.close()
    wait_for(lambda: lists.last() == [], timeout_s=2)

    closing = time.monotonic()
    watcher.close()
    assert time.monotonic() - closing < 1.0


@pytest.mark.timeout(60)
def test_a_registration_whose_lease_is_gone_registers_again(registry, shared_etcd):
    """The lease vanishing under a live worker (it expired while the worker was cut off from etcd): the heartbeat
    grants a new lease and puts the record again."""
    etcd = raw_client(shared_etcd)
    prefix = f"/{registry.namespace}/workers/"
    registration = registry.register(worker("d0"), load=dict)
    ((_, record),) = etcd.get_prefix(prefix)
    etcd.post(etcd.get_url("/kv/lease/revoke"), json={"ID": record["lease"]})
    assert registry.workers() == []

    wait_for(lambda: ids(registry.workers()) == ["d0"], timeout_s=TTL_S)

    ((_, again),) = etcd.get_prefix(prefix)
    assert again["lease"] != record["lease"]
    registration.close()


@pytest.mark.timeout(60)
def test_worker_and_watcher_come_back_by_themselves_after_an_etcd_restart(tmp_path):
    server = EtcdServer(tmp_path, etcd_or_skip())
    registry = EtcdRegistry(server.endpoint, ttl_s=TTL_S, timeout_s=0.5)
    registration = registry.register(worker("d0"), load=dict)
    lists = Lists()
    watcher = registry.watch(lists, resync_s=0.5)
    wait_for(lambda: lists.last() == ["d0"], timeout_s=2)
    try:
        server.stop()
        wait_for(lambda: not watcher.healthy, timeout_s=2)
        with pytest.raises(RegistryError, match=server.endpoint):
            registry.workers()
        received = len(lists.received)
        time.sleep(1.0)
        assert len(lists.received) == received  # an outage is not an empty list: the router keeps its last one

        server.start()
        wait_for(lambda: watcher.healthy and len(lists.received) > received, timeout_s=5)
        wait_for(lambda: lists.last() == ["d0"], timeout_s=TTL_S)
        assert ids(registry.workers()) == ["d0"]
        registration.close()  # the new connection works both ways: the worker leaves and the watcher sees it
        wait_for(lambda: lists.last() == [], timeout_s=2)
    finally:
        watcher.close()
        server.stop()


@pytest.mark.timeout(60)
def test_a_watch_lost_to_a_quick_etcd_restart_is_opened_again_after_the_next_resync(tmp_path):
    """etcd restarts between two reads: the watch stream is dead and says nothing. The next resync finds the change
    it missed, so the watcher opens a new stream and the change after that is seen at once (by the new worker's
    first put or, if the stream is still opening, its first heartbeat's)."""
    server = EtcdServer(tmp_path, etcd_or_skip())
    registry = EtcdRegistry(server.endpoint, ttl_s=TTL_S)
    lists = Lists()
    watcher = registry.watch(lists, resync_s=3)
    registrations = []
    try:
        wait_for(lambda: lists.last() == [], timeout_s=2)
        server.stop()
        server.start()
        registrations.append(registry.register(worker("d0"), load=dict))
        wait_for(lambda: lists.last() == ["d0"], timeout_s=4)

        registrations.append(registry.register(worker("d1"), load=dict))
        wait_for(lambda: lists.last() == ["d0", "d1"], timeout_s=1.5)
    finally:
        watcher.close()
        for registration in registrations:
            registration.close()
        server.stop()


@pytest.mark.timeout(60)
def test_without_etcd_check_register_and_workers_say_where_and_how_to_start_it():
    (port,) = free_ports(1)
    registry = EtcdRegistry(f"http://127.0.0.1:{port}", timeout_s=0.5)

    for attempt in (registry.check, registry.workers, lambda: registry.register(worker("d0"), load=dict)):
        with pytest.raises(RegistryError) as raised:
            attempt()
        message = str(raised.value)
        assert f"http://127.0.0.1:{port}" in message
        assert "Connection refused" in message and "apt install etcd-server" in message
        assert "--prefill/--decode" in message


def test_worker_records_round_trip_and_refuse_what_is_not_one():
    info = WorkerInfo("p0", "prefill", "http://127.0.0.1:8000", "llama-fp32", {"kv_usage": 0.25})
    assert WorkerInfo.from_json(info.to_json().encode()) == info
    with pytest.raises(RegistryError, match="role 'encode'"):
        WorkerInfo("e0", "encode", "http://127.0.0.1:8000", "llama-fp32")
    with pytest.raises(RegistryError, match="not a worker record"):
        WorkerInfo.from_json('{"worker_id": "p0"}')
