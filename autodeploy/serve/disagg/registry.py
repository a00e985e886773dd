"""Service discovery for disaggregated serving: workers register themselves in etcd, the router reads the live set.

A worker puts its record (role, URL, fingerprint, load) under ``/{namespace}/workers/{worker_id}``, attached to an
etcd lease that a daemon thread keeps alive. A worker that crashes stops refreshing, so etcd deletes its record when
the lease expires (``ttl_s``) — nobody has to notice the crash. The router watches the prefix and gets the whole
list again on every change, and at least every ``resync_s`` seconds, because an etcd3gw watch that breaks (etcd
restarted) says nothing.

The client is ``etcd3gw``: etcd's v3 JSON gateway over plain HTTP, maintained, and without the generated gRPC stubs
that tie the ``etcd3`` package to old protobuf versions. It is imported only when a registry is made, so
``autodeploy`` imports without it.

    registry = EtcdRegistry("http://127.0.0.1:2379", ttl_s=10)
    registry.check()
    registration = registry.register(WorkerInfo("decode-0", "decode", "http://127.0.0.1:8001", "llama-bf16"), load=dict)
    watcher = registry.watch(lambda workers: print([worker.worker_id for worker in workers]))
    ...
    watcher.close()
    registration.close()
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from autodeploy.errors import RegistryError

if TYPE_CHECKING:
    from etcd3gw.client import Etcd3Client
    from etcd3gw.lease import Lease

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")


@dataclass
class WorkerInfo:
    """What a worker publishes about itself; the router pairs a prefill with a decode worker of the same fingerprint."""

    worker_id: str  # unique per worker process
    role: str  # "prefill" | "decode" | "both"
    url: str  # the worker's HTTP base URL, e.g. "http://127.0.0.1:8001"
    fingerprint: str  # model/dtype/KV-layout fingerprint; workers with different ones must not be paired
    load: dict = field(default_factory=dict)  # e.g. {"queued_prompt_tokens": 0, "kv_usage": 0.0, "running": 0}

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise RegistryError(f"worker {self.worker_id!r} has role {self.role!r}; give one of {', '.join(ROLES)}")

    def to_json(self) -> str:
        # ASCII JSON: etcd3gw encodes str values as latin-1.
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerInfo:
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as error:
            raise RegistryError(f"not a worker record ({error}): {text[:200]!r}") from error


class EtcdRegistry:
    """Workers under ``/{namespace}/workers/`` in the etcd at ``endpoint``.

    ``ttl_s`` is how long a worker that stopped heartbeating stays listed (etcd counts whole seconds and raises
    short leases to its minimum, 2 s by default); ``timeout_s`` bounds every request to etcd.
    """

    def __init__(self, endpoint: str = "http://127.0.0.1:2379", namespace: str = "autodeploy", ttl_s: float = 10.0,
                 timeout_s: float = 2.0) -> None:
        _import_etcd3gw()  # fail here, not in a thread, when the client is missing
        parts = urlsplit(endpoint)
        try:
            port = parts.port or 2379
        except ValueError as error:
            raise RegistryError(f"etcd endpoint {endpoint!r}: {error}; give one like http://127.0.0.1:2379") from error
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RegistryError(f"etcd endpoint {endpoint!r} is not an http(s) URL; give one like http://127.0.0.1:2379")
        self.endpoint = endpoint
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._address = (parts.scheme, parts.hostname, port)
        self._prefix = f"/{namespace}/workers/"
        # One client per thread: a requests.Session is not thread-safe.
        self._clients = threading.local()

    def check(self) -> None:
        """Raise ``RegistryError`` naming the endpoint and the fix unless etcd answers within ``timeout_s``."""
        with self._reaching_etcd():
            self._client().status()

    def register(self, info: WorkerInfo, load: Callable[[], dict]) -> Registration:
        """Put ``info`` (with ``load()`` as its load) in etcd and keep it there until ``close()`` or the process dies.

        Raises ``RegistryError`` when etcd cannot be reached now; later outages are retried in the background.
        """
        return Registration(self, info, load)

    def workers(self) -> list[WorkerInfo]:
        """The registered workers now; a record that does not parse is skipped with a warning."""
        with self._reaching_etcd():
            rows = self._client().get_prefix(self._prefix)
        workers = []
        for value, metadata in rows:
            try:
                workers.append(WorkerInfo.from_json(value))
            except RegistryError as error:
                logger.warning("skipping %s in etcd at %s: %s", metadata["key"].decode(errors="replace"),
                               self.endpoint, error)
        return workers

    def watch(self, on_change: Callable[[list[WorkerInfo]], None], resync_s: float = 1.0) -> Watcher:
        """Call ``on_change(workers)`` at once, on every change, and at least every ``resync_s`` seconds; see ``Watcher``."""
        return Watcher(self, on_change, resync_s)

    def _worker_key(self, worker_id: str) -> str:
        return self._prefix + worker_id

    def _lease_ttl(self) -> int:
        return max(1, math.ceil(self.ttl_s))

    def _new_client(self) -> Etcd3Client:
        protocol, host, port = self._address
        return _import_etcd3gw().client(host=host, port=port, protocol=protocol, timeout=self.timeout_s)

    def _client(self) -> Etcd3Client:
        if not hasattr(self._clients, "client"):
            self._clients.client = self._new_client()
        return self._clients.client

    @contextmanager
    def _reaching_etcd(self) -> Iterator[None]:
        """etcd3gw's errors, and the requests errors it lets through, as one ``RegistryError`` that names the fix."""
        try:
            yield
        except _client_errors() as error:
            raise RegistryError(
                f"etcd at {self.endpoint} is unreachable or failing ({_reason(error)}; timeout {self.timeout_s:g} s). "
                f"Start etcd: `etcd --data-dir ./etcd-data --listen-client-urls {self.endpoint} "
                f"--advertise-client-urls {self.endpoint}` (Debian: apt install etcd-server), "
                "or give the router static --prefill/--decode URLs.") from error


class Registration:
    """A worker's record in etcd, kept alive by a daemon thread that refreshes its lease and puts the record with
    the current load every ``ttl_s / 3`` seconds. If the lease is gone (it expired, or etcd lost it), the thread
    grants a new one and puts the record again; while etcd is unreachable it retries, warning once per outage."""

    def __init__(self, registry: EtcdRegistry, info: WorkerInfo, load: Callable[[], dict]) -> None:
        self._registry = registry
        self._info = info
        self._load = load
        self._client = registry._new_client()  # used by one thread at a time: this one, then the heartbeat's
        self._lease: Lease | None = None
        self._stop = threading.Event()
        self._outage = _Outage(
            f"worker {info.worker_id} cannot refresh its registration in etcd at {registry.endpoint}; retrying every "
            f"{registry.ttl_s / 3:.2g} s", f"worker {info.worker_id} is registered in etcd at {registry.endpoint} again")
        with registry._reaching_etcd():
            self._refresh()
        self._thread = threading.Thread(target=self._heartbeat, name=f"etcd-heartbeat-{info.worker_id}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the heartbeat and revoke the lease, so the worker leaves at once (best effort: if etcd is down, the
        record goes when the lease expires)."""
        self._stop.set()
        self._thread.join()  # no put may follow the revoke
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            lease.revoke()
        except _client_errors() as error:
            logger.warning("worker %s: could not revoke its lease in etcd at %s (%s); it leaves when the lease "
                           "expires, within %g s", self._info.worker_id, self._registry.endpoint, _reason(error),
                           self._registry.ttl_s)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._registry.ttl_s / 3):
            try:
                self._refresh()
            except Exception as error:  # the thread must outlive any outage, and load() is the caller's code
                self._outage.failed(error)
            else:
                self._outage.ended()

    def _refresh(self) -> None:
        if self._lease is None or self._lease.refresh() <= 0:  # -1: etcd no longer knows the lease
            self._lease = self._client.lease(self._registry._lease_ttl())
        record = replace(self._info, load=self._load())
        self._client.put(self._registry._worker_key(self._info.worker_id), record.to_json(), lease=self._lease)


class Watcher:
    """A daemon thread that calls ``on_change(workers)`` at once, on every change under the workers' prefix, and at
    least every ``resync_s`` seconds. While etcd is unreachable it does not call ``on_change`` (the caller keeps its
    last list) and retries; ``healthy`` says whether the last attempt reached etcd. ``on_change`` runs on the
    watcher's thread; an exception from it is logged and the watcher goes on."""

    def __init__(self, registry: EtcdRegistry, on_change: Callable[[list[WorkerInfo]], None], resync_s: float) -> None:
        self.healthy = False
        self._registry = registry
        self._on_change = on_change
        self._resync_s = resync_s
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._stream: _PrefixStream | None = None  # used by the watcher's thread only
        self._outage = _Outage(
            f"etcd at {registry.endpoint} is unreachable; keeping the last list of workers, retrying every {resync_s:g} s",
            f"etcd at {registry.endpoint} answers again")
        # An open etcd3gw watch holds the interpreter at exit (futurist joins its reader thread): close first.
        atexit.register(self.close)
        self._thread = threading.Thread(target=self._run, name="etcd-watcher", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread: at once, or after the request to etcd in flight (at most ``timeout_s``)."""
        self._closed.set()
        self._wake.set()
        self._thread.join()
        atexit.unregister(self.close)

    def _run(self) -> None:
        delivered: list[WorkerInfo] | None = None
        woken_by_event = False
        while not self._closed.is_set():
            try:
                workers = self._registry.workers()
            except RegistryError as error:
                self.healthy = False
                self._outage.failed(error.__cause__ or error)  # the etcd3gw error in a few words, not the whole fix
                self._drop_stream()  # the outage broke it; watch again once etcd answers
            else:
                self.healthy = True
                self._outage.ended()
                if not woken_by_event and workers != delivered:
                    self._drop_stream()  # a change its watch did not report: lost (etcd restarted in between)
                self._stream = self._stream or _PrefixStream(self._registry, self._wake)
                delivered = workers
                self._deliver(workers)
            woken_by_event = self._wake.wait(self._resync_s)
            self._wake.clear()
        self._drop_stream()

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _deliver(self, workers: list[WorkerInfo]) -> None:
        try:
            self._on_change(workers)
        except Exception:  # the router's bug must not stop discovery
            logger.exception("on_change of the etcd watcher at %s failed", self._registry.endpoint)


class _PrefixStream:
    """One etcd watch on the workers' prefix that sets ``wake`` on every event. It opens in a thread of its own,
    because etcd3gw opens a watch without a timeout, on a client of its own, because cancelling an etcd3gw watch
    closes its client's connection pool."""

    def __init__(self, registry: EtcdRegistry, wake: threading.Event) -> None:
        self._registry = registry
        self._wake = wake
        self._lock = threading.Lock()
        self._cancel: Callable[[], None] | None = None
        self._closed = False
        threading.Thread(target=self._run, name="etcd-watch-stream", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            cancel = self._cancel
        if cancel is not None:
            cancel()

    def _run(self) -> None:
        try:
            events, cancel = self._registry._new_client().watch_prefix(self._registry._prefix)
        except _client_errors() as error:  # the watcher's next read finds the outage and opens a new stream
            logger.debug("cannot watch etcd at %s: %s", self._registry.endpoint, _reason(error))
            return
        with self._lock:
            self._cancel = cancel
            closed = self._closed
        if closed:
            cancel()
        for _event in events:
            self._wake.set()


class _Outage:
    """A warning when etcd first fails and a line when it answers again: once per outage, not once per retry."""

    def __init__(self, warning: str, recovered: str) -> None:
        self._warning = warning
        self._recovered = recovered
        self._ongoing = False

    def failed(self, error: BaseException) -> None:
        if not self._ongoing:
            logger.warning("%s (%s)", self._warning, _reason(error))
            self._ongoing = True

    def ended(self) -> None:
        if self._ongoing:
            logger.info(self._recovered)
            self._ongoing = False


def _reason(error: BaseException) -> str:
    """The cause in a few words: requests buries it (``[Errno 111] Connection refused``) in a long repr, and
    etcd3gw keeps its message in ``detail_text``."""
    text = " ".join((getattr(error, "detail_text", None) or str(error) or type(error).__name__).split())
    errno = re.search(r"\[Errno -?\d+\] [^'\"();]+", text)
    if errno:
        return errno.group(0).strip()
    return text if len(text) <= 200 else text[:200] + " …"


def _client_errors() -> tuple[type[Exception], ...]:
    from etcd3gw.exceptions import Etcd3Exception
    from requests import RequestException

    return Etcd3Exception, RequestException


def _import_etcd3gw() -> ModuleType:
    try:
        import etcd3gw
    except ImportError as error:
        raise RegistryError("discovery in etcd needs the etcd3gw client: pip install etcd3gw") from error
    return etcd3gw
