"""``autodeploy router``: the OpenAI-compatible front end of disaggregated serving.

Each generation request goes to a prefill worker first (``x-autodeploy-disagg: prefill``), which computes the
prompt and holds its KV blocks; then to a decode worker with where to pull them (``x-autodeploy-kv``), whose
answer — a JSON body, or a stream — the router passes on as it comes. The decode worker formats everything (chat
templates, tools, logprobs, usage), so the router answers exactly what one ``serve`` process would. Other routes
(``/v1/models``, ``/tokenize``, …) go to a decode worker as they are.

Workers come from etcd (``registry.py``: each registers its role, URL, fingerprint and load under a lease) or from
static ``--prefill`` / ``--decode`` URLs, whose ``/disagg/load`` the router polls. All of a router's workers serve
one model: the one most of the workers it first sees serve (ties: the first listed), and a worker with another is
refused (logged, listed by ``/health``).

Choosing: a prefill worker by its waiting prompt tokens, a decode worker by its KV pool's use and running
sequences, each counting what the router sent it since its last report; a request goes where its prompt's prefix
went before (its KV may be cached there) unless that worker is busier than the least busy by more than
``affinity_slack``.

Failures: a worker that refuses a connection, breaks one, answers 5xx, or lets a stream stall (``stall_timeout_s``
without a byte: hung) is marked down (and skipped until it is
seen alive again), and the request goes to another: a prefill on another prefill worker (or, with none left, the
decode worker computes the prompt), an answer not yet begun on another decode worker. A stream a decode worker
broke after it began is *resumed* on another (``x-autodeploy-resume``: the tokens streamed so far, sampled at the
same steps), so no request is lost and no token is sent twice; only a stream of several prompts or samples, which
no one worker can resume, ends with an error event. Every call has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from autodeploy.errors import ConfigError
from autodeploy.serve.disagg.worker import KV_HEADER, PHASE_HEADER, RESUME_HEADER, TOKENS_HEADER

logger = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RouterOptions:
    """``prefill`` / ``decode``: static worker URLs (with no ``etcd``). ``etcd``: the registry's endpoint.
    ``poll_s``: how often static workers' loads are read. ``down_s``: how long a worker that failed is skipped
    before it is tried again (it is back at once when the registry or a poll sees it alive). ``attempts``: workers
    tried per phase. ``timeout_s``: a request's deadline at a worker; ``connect_timeout_s``: a connection's;
    ``stall_timeout_s``: how long a stream may go without a byte before its worker counts as hung (the stream resumes
    on another)."""

    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    etcd: str | None = None
    namespace: str = "autodeploy"
    poll_s: float = 1.0
    down_s: float = 5.0
    attempts: int = 3
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    stall_timeout_s: float = 120.0
    affinity_slack: float = 1.5


@dataclass
class _Worker:
    url: str
    role: str
    fingerprint: str | None = None
    load: dict = field(default_factory=dict)
    sent: int = 0  # requests (decode) or prompt characters / 4 (prefill) sent since the last load report
    down_until: float = 0.0

    def serves(self, phase: str) -> bool:
        return self.role in (phase, "both")


class WorkerPool:
    """The live workers and how to choose among them (thread-safe: the registry's watcher updates it)."""

    def __init__(self, affinity_slack: float = 1.5):
        self.affinity_slack = affinity_slack
        self.fingerprint: str | None = None
        self.refused: dict[str, str] = {}  # url → why
        self._workers: dict[str, _Worker] = {}
        self._affinity: OrderedDict[tuple[str, str], str] = OrderedDict()  # (phase, prefix key) → url
        self._lock = threading.Lock()

    def update(self, url: str, role: str, fingerprint: str | None, load: dict) -> None:
        """A worker seen alive, with its load now."""
        with self._lock:
            if fingerprint is not None:
                if self.fingerprint is None:
                    self.fingerprint = fingerprint
                elif fingerprint != self.fingerprint:
                    if url not in self.refused:
                        logger.error("refusing worker %s: it serves model/KV layout %s, the router's workers %s", url,
                                     fingerprint, self.fingerprint)
                    self.refused[url] = f"fingerprint {fingerprint} differs from the router's {self.fingerprint}"
                    self._workers.pop(url, None)
                    return
            self.refused.pop(url, None)
            worker = self._workers.setdefault(url, _Worker(url, role))
            worker.role, worker.fingerprint, worker.load, worker.sent, worker.down_until = role, fingerprint, load, 0, 0.0

    def settle_fingerprint(self, fingerprints: list[str | None]) -> None:
        """Before any worker is taken: the model the router serves is the one most of ``fingerprints`` serve (ties: the
        first listed), so a stray worker of another model is the one refused, whoever answers first."""
        with self._lock:
            known = [f for f in fingerprints if f is not None]
            if self.fingerprint is None and known:
                self.fingerprint = max(dict.fromkeys(known), key=known.count)

    def keep_only(self, urls: set[str]) -> None:
        """Forget the workers not in ``urls`` (they left the registry)."""
        with self._lock:
            for url in list(self._workers):
                if url not in urls:
                    del self._workers[url]

    def down(self, url: str, seconds: float) -> None:
        with self._lock:
            if url in self._workers:
                self._workers[url].down_until = time.monotonic() + seconds
                logger.warning("worker %s is down; skipped for %.0f s unless seen alive", url, seconds)

    def live(self, phase: str | None = None) -> list[_Worker]:
        now = time.monotonic()
        with self._lock:
            return [w for w in self._workers.values() if w.down_until <= now and (phase is None or w.serves(phase))]

    def choose(self, phase: str, key: str, exclude: set[str], cost: int) -> _Worker | None:
        """The worker for ``phase`` (see the module docstring); ``cost``: what this request adds to its count."""
        candidates = [w for w in self.live(phase) if w.url not in exclude]
        if not candidates:
            return None
        with self._lock:
            scores = {w.url: self._busy(phase, w) for w in candidates}
            best = min(candidates, key=lambda w: scores[w.url])
            preferred = self._affinity.get((phase, key))
            if preferred in scores and scores[preferred] <= scores[best.url] * self.affinity_slack + 1:
                best = next(w for w in candidates if w.url == preferred)
            self._affinity[(phase, key)] = best.url
            self._affinity.move_to_end((phase, key))
            while len(self._affinity) > 100_000:
                self._affinity.popitem(last=False)
            best.sent += cost
            return best

    @staticmethod
    def _busy(phase: str, worker: _Worker) -> float:
        load = worker.load
        if phase == "prefill":
            return load.get("queued_prompt_tokens", 0) + worker.sent
        return 100 * load.get("kv_usage", 0.0) + load.get("running", 0) + load.get("waiting", 0) + worker.sent

    def counts(self) -> dict[str, int]:
        live = self.live()
        return {"prefill": sum(w.serves("prefill") for w in live), "decode": sum(w.serves("decode") for w in live)}


class Router:
    """Sends requests through the workers (see the module docstring)."""

    def __init__(self, options: RouterOptions):
        if options.etcd is None and not options.decode:
            raise ConfigError("the router needs workers: --etcd URL (workers register there), or static --decode URL "
                              "(and --prefill URL) lists")
        self.options = options
        self._registry = None
        if options.etcd:  # before the server starts: no etcd fails `autodeploy router` at once, saying how to start it
            from autodeploy.serve.disagg.registry import EtcdRegistry

            self._registry = EtcdRegistry(options.etcd, options.namespace)
            self._registry.check()
        self.pool = WorkerPool(options.affinity_slack)
        self.registry_healthy: bool | None = None
        self._client: httpx.AsyncClient | None = None
        self._watcher = None
        self._poller: asyncio.Task | None = None
        metrics = self.metrics = CollectorRegistry()
        self.requests = Counter("autodeploy_router_requests", "Generation requests routed", ["route"], registry=metrics)
        self.failovers = Counter("autodeploy_router_failovers", "Calls sent to another worker after one failed",
                                 ["phase"], registry=metrics)
        self.resumed = Counter("autodeploy_router_resumed_streams", "Streams resumed on another decode worker", registry=metrics)
        self.local_prefills = Counter("autodeploy_router_local_prefills",
                                      "Requests whose decode worker computed the prompt (no prefill worker answered)",
                                      registry=metrics)
        workers = Gauge("autodeploy_router_live_workers", "Workers the router can send to", ["role"], registry=metrics)
        for role in ("prefill", "decode"):
            workers.labels(role).set_function(lambda role=role: self.pool.counts()[role])

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        timeout = httpx.Timeout(self.options.timeout_s, connect=self.options.connect_timeout_s)
        self._client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        if self._registry is not None:
            self._watcher = self._registry.watch(self._registered)
        else:
            await self._poll_once()
            self._poller = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self._client.aclose()

    def _registered(self, infos) -> None:
        self.pool.keep_only({info.url for info in infos})
        self.pool.settle_fingerprint([info.fingerprint for info in infos])
        for info in infos:
            self.pool.update(info.url, info.role, info.fingerprint, info.load)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.options.poll_s)
            await self._poll_once()

    async def _poll_once(self) -> None:
        """Every static worker's load, read at once, then applied in the order the workers were given (so which
        fingerprint the router takes does not depend on who answered first)."""
        urls = [(url, "prefill") for url in self.options.prefill] + [(url, "decode") for url in self.options.decode]
        answers = await asyncio.gather(*(self._read_load(url) for url, _ in urls))
        self.pool.settle_fingerprint([info.get("fingerprint") for info in answers if info is not None])
        for (url, role), info in zip(urls, answers):
            if info is None:
                if any(w.url == url for w in self.pool.live()):
                    self.pool.down(url, self.options.poll_s)
            elif info.get("role") not in (role, "both"):
                self.pool.refused[url] = f"given as a {role} worker, it serves role {info.get('role')!r}"
            else:
                self.pool.update(url, role, info.get("fingerprint"), info.get("load", {}))

    async def _read_load(self, url: str) -> dict | None:
        try:
            response = await self._client.get(f"{url}/disagg/load", timeout=self.options.connect_timeout_s)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError):
            return None

    # ---- requests ------------------------------------------------------------------------------
    async def route(self, request: Request, path: str) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        headers = _forwarded(request.headers)
        if path not in GENERATION_ROUTES or not isinstance(payload, dict):
            return await self._proxy(request.method, path, body, headers)
        self.requests.labels(path).inc()
        key = _prefix_key(payload)
        transfers = await self._prefill(path, body, headers, key, len(body) // 4)
        if isinstance(transfers, Response):  # the request's own fault (a 4xx), as one server would answer it
            return transfers
        if payload.get("stream"):  # begun before the answer's status is sent, so a 4xx or 503 is the client's status too
            tried: set[str] = set()
            opened = await self._open(path, body, headers, key, transfers, None, tried)
            if isinstance(opened, Response):
                return opened
            return StreamingResponse(self._stream(path, payload, headers, key, tried, opened), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._decode(path, body, headers, key, transfers)

    async def _prefill(self, path: str, body: bytes, headers: dict, key: str, cost: int,
                       resume: str | None = None) -> str | Response | None:
        """The ``x-autodeploy-kv`` header for the decode worker; None when no prefill worker answered (the decode
        worker computes the prompt itself); a prefill worker's 4xx (the request's own fault) as it came."""
        tried: set[str] = set()
        extra = {PHASE_HEADER: "prefill", **({RESUME_HEADER: resume} if resume else {})}
        busy = None  # the last "queue full" answer: with every worker full, the client gets it (and its Retry-After)
        for _ in range(self.options.attempts):
            worker = self.pool.choose("prefill", key, tried, cost)
            if worker is None:
                break
            tried.add(worker.url)
            try:
                response = await self._client.post(f"{worker.url}{path}", content=body, headers={**headers, **extra})
            except httpx.HTTPError as error:
                self._failed("prefill", worker.url, error)
                continue
            if response.status_code == 200:
                return json.dumps(response.json()["kv_transfer"])
            if _busy(response):
                busy = response
                continue
            if response.status_code < 500:  # resuming, the decode worker computes the prompt instead
                return None if resume else _passed_on(response)
            self._failed("prefill", worker.url, f"HTTP {response.status_code}")
        if busy is not None and not resume:
            return _passed_on(busy)
        self.local_prefills.inc()
        return None

    async def _decode(self, path: str, body: bytes, headers: dict, key: str, transfers: str | None) -> Response:
        tried: set[str] = set()
        busy = None
        for _ in range(self.options.attempts):
            worker = self.pool.choose("decode", key, tried, 1)
            if worker is None:
                break
            tried.add(worker.url)
            try:
                response = await self._client.post(f"{worker.url}{path}", content=body,
                                                   headers={**headers, **({KV_HEADER: transfers} if transfers else {})})
            except httpx.HTTPError as error:
                self._failed("decode", worker.url, error)
                continue
            if _busy(response):
                busy = response
                continue
            if response.status_code >= 500:  # aborted (shutting down) or failed: another worker answers
                self._failed("decode", worker.url, f"HTTP {response.status_code}")
                continue
            return _passed_on(response)
        return _passed_on(busy) if busy is not None else _no_worker("decode")

    async def _open(self, path: str, body: bytes, headers: dict, key: str, transfers: str | None, resume: str | None,
                    tried: set[str]) -> tuple[str, httpx.Response] | Response:
        """A decode worker's stream that began (200), with the worker's URL; or the answer the client gets instead: a
        4xx as it came, the last "queue full" 503 when every worker tried was full, or a 503 when none was left."""
        extra = {TOKENS_HEADER: "1", **({KV_HEADER: transfers} if transfers else {}), **({RESUME_HEADER: resume} if resume else {})}
        busy = None
        while len(tried) < self.options.attempts + 1:
            worker = self.pool.choose("decode", key, tried, 1)
            if worker is None:
                break
            tried.add(worker.url)
            timeout = httpx.Timeout(self.options.timeout_s, connect=self.options.connect_timeout_s, read=self.options.stall_timeout_s)
            request = self._client.build_request("POST", f"{worker.url}{path}", content=body, headers={**headers, **extra},
                                                 timeout=timeout)
            try:
                response = await self._client.send(request, stream=True)
            except httpx.HTTPError as error:
                self._failed("decode", worker.url, error)
                continue
            if response.status_code == 200:
                return worker.url, response
            await response.aread()
            await response.aclose()
            if _busy(response):
                busy = response
            elif response.status_code >= 500:
                self._failed("decode", worker.url, f"HTTP {response.status_code}")
            else:
                return _passed_on(response)
        return _passed_on(busy) if busy is not None else _no_worker("decode")

    async def _stream(self, path: str, payload: dict, headers: dict, key: str, tried: set[str],
                      opened: tuple[str, httpx.Response]) -> AsyncIterator[str]:
        """The decode worker's events, its annotations stripped; a stream broken part way resumes on another worker."""
        streamed: dict[int, tuple[list[int], list[str]]] = {}  # choice index → (token ids, text pieces) sent
        body = json.dumps(payload).encode()
        while True:
            url, response = opened
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        yield "data: [DONE]\n\n"
                        return
                    event = json.loads(data)
                    if _aborted_event(event):
                        raise httpx.ReadError("the worker aborted the stream (it is shutting down)")
                    forwarded = _stripped(event, streamed)
                    if forwarded is not None:
                        yield f"data: {json.dumps(forwarded)}\n\n"
                raise httpx.ReadError("the stream ended before [DONE]")
            except httpx.HTTPError as error:
                self._failed("decode", url, error)
            finally:
                await response.aclose()
            resume = transfers = None
            if streamed:
                if len(streamed) > 1 or payload.get("n", 1) != 1 or not _one_prompt(payload):
                    break
                tokens, pieces = streamed[next(iter(streamed))]
                resume = json.dumps({"token_ids": tokens, "text": "".join(pieces)})
                self.resumed.inc()
            prefilled = await self._prefill(path, body, headers, key, len(body) // 4, resume)  # its KV again, elsewhere
            transfers = prefilled if isinstance(prefilled, str) else None
            opened = await self._open(path, body, headers, key, transfers, resume, tried)
            if isinstance(opened, Response):
                yield f"data: {opened.body.decode()}\n\n"
                yield "data: [DONE]\n\n"
                return
        error = {"error": {"message": "the decode worker failed mid-stream, and a stream of several prompts or samples cannot "
                                      "be resumed on another; send the request again",
                           "type": "service_unavailable", "code": "not_resumable"}}
        yield f"data: {json.dumps(error)}\n\n"
        yield "data: [DONE]\n\n"

    async def _proxy(self, method: str, path: str, body: bytes, headers: dict) -> Response:
        """Any other route, on a decode worker, as it answers (a stream passed on as it comes). The workers in URL order,
        so routes with state (``/v1/files``, ``/v1/batches``) find it on the same worker while it lives."""
        for worker in sorted(self.pool.live("decode"), key=lambda w: w.url)[: self.options.attempts]:
            request = self._client.build_request(method, f"{worker.url}{path}", content=body, headers=headers)
            try:
                response = await self._client.send(request, stream=True)
            except httpx.HTTPError as error:
                self._failed("decode", worker.url, error)
                continue
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                await response.aread()
                await response.aclose()
                return _passed_on(response)
            return StreamingResponse(_relayed(response), response.status_code, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return _no_worker("decode")

    def _failed(self, phase: str, url: str, error) -> None:
        logger.warning("%s worker %s failed (%s); trying another", phase, url, error)
        self.failovers.labels(phase).inc()
        self.pool.down(url, self.options.down_s)

    def health(self) -> tuple[int, dict]:
        counts = self.pool.counts()
        body = {"status": "ok" if counts["decode"] else "unavailable", "workers": counts, "fingerprint": self.pool.fingerprint,
                "refused": dict(self.pool.refused)}
        if self._watcher is not None:
            body["registry"] = "ok" if self._watcher.healthy else "unreachable (serving the last known workers)"
        return (200 if counts["decode"] else 503), body


def build_router_app(options: RouterOptions) -> FastAPI:
    """The router's FastAPI app (see the module docstring)."""
    router = Router(options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="autodeploy router", lifespan=lifespan)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        status, body = router.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics), media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def routed(path: str, request: Request) -> Response:
        return await router.route(request, "/" + path)

    return app


async def _relayed(response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    finally:
        await response.aclose()


def _forwarded(headers) -> dict:
    """The client's headers a worker should see (its API key, content type), none of the router's own."""
    keep = ("authorization", "content-type", "accept")
    return {name: value for name, value in headers.items() if name.lower() in keep}


def _prefix_key(payload: dict) -> str:
    """A key of the prompt's first characters: requests that share it likely share cached KV blocks."""
    prompt = payload.get("messages", payload.get("prompt", ""))
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return hashlib.blake2b(text[:1024].encode(), digest_size=8).hexdigest()


def _one_prompt(payload: dict) -> bool:
    prompt = payload.get("prompt")
    return "messages" in payload or isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int))


def _stripped(event: dict, streamed: dict[int, tuple[list[int], list[str]]]) -> dict | None:
    """``event`` without the worker's annotations (recorded in ``streamed``), or None when nothing is left to send."""
    choices = event.get("choices")
    if not choices:
        return event
    kept = []
    for choice in choices:
        note = choice.pop("autodeploy", None)
        if note is not None:
            tokens, pieces = streamed.setdefault(choice["index"], ([], []))
            tokens.extend(note["token_ids"])
            pieces.append(note["text"])
        if not choice.pop("autodeploy_only", False):
            kept.append(choice)
    if not kept:
        return None
    event["choices"] = kept
    return event


def _busy(response: httpx.Response) -> bool:
    """A worker's "queue full" (503, not a shutdown's "aborted"): a load signal, not a failure."""
    return response.status_code == 503 and b'"aborted"' not in response.content


def _passed_on(response: httpx.Response) -> Response:
    headers = {name: response.headers[name] for name in ("retry-after",) if name in response.headers}
    return Response(response.content, response.status_code, headers=headers, media_type=response.headers.get("content-type"))


def _aborted_event(event: dict) -> bool:
    error = event.get("error")
    return isinstance(error, dict) and error.get("code") == "aborted"


def _no_worker(phase: str) -> Response:
    return JSONResponse({"error": {"message": f"no {phase} worker is available; start one (autodeploy serve MODEL --role {phase}) "
                                              f"or check /health", "type": "service_unavailable", "code": "no_worker"}},
                        status_code=503, headers={"Retry-After": "1"})
