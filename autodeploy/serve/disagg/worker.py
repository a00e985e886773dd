"""A disaggregated worker: ``autodeploy serve MODEL --role prefill | decode``.

A worker is the ordinary OpenAI server (``serve/app.py``) with three headers that only the router sends:

- ``x-autodeploy-disagg: prefill`` — compute the prompt(s) (one token is sampled and thrown away), *hold* their
  KV blocks (``KVHandoff.hold``) and answer where to pull them from: ``{"kv_transfer": [{source, transfer_id, keys,
  fingerprint}, …]}``, one per prompt. The blocks stay held until the decode worker releases them, or for
  ``hold_ttl_s`` at most.
- ``x-autodeploy-kv: <that list, JSON>`` — before running the request, pull each prompt's blocks into this engine's
  prefix cache (``transfer.receive``); then serve the request as usual: it finds its prompt cached, computes the
  last partial block and generates every token itself.
- ``x-autodeploy-resume: {"token_ids": [...], "text": "..."}`` — a request another decode worker was streaming when
  it died: the tokens it streamed become the start of this one's completion (sampled at the same steps, so a seeded
  request draws what it would have), and the stream goes on from the text already sent.
  ``x-autodeploy-stream-tokens: 1`` makes each streamed choice carry its new token ids and raw text, for that.

The worker serves its blocks over gRPC (``transfer.py``), registers in etcd with its load (``registry.py``), and
answers ``GET /disagg/load``. Roles need the prefix cache (the hand-off goes through it) and one rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from autodeploy.errors import ConfigError, InvalidRequestError, TransferError
from autodeploy.frontend.llm import LLM
from autodeploy.runtime.request import Request as EngineRequest

logger = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
PHASE_HEADER = "x-autodeploy-disagg"
KV_HEADER = "x-autodeploy-kv"
RESUME_HEADER = "x-autodeploy-resume"
TOKENS_HEADER = "x-autodeploy-stream-tokens"


@dataclass
class WorkerOptions:
    """``role``: "prefill", "decode" or "both" (a worker that does either, and a plain server). ``url``: the base URL
    the router reaches this worker's HTTP API at. ``kv_host`` / ``kv_port``: where its KV transfer service listens (0:
    any free port). ``etcd``: the registry's endpoint (None: no registration; the router is given static URLs).
    ``hold_ttl_s``: how long a prefill worker keeps a prompt's blocks for a decode worker that has not pulled them.
    ``transfer_timeout_s`` / ``transfer_retries``: a pull's deadline and how many times missing blocks are asked for
    again. ``heartbeat_ttl_s``: the registration's lease (a worker that dies leaves the registry after it)."""

    role: str = "both"
    url: str = ""
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    etcd: str | None = None
    namespace: str = "autodeploy"
    hold_ttl_s: float = 60.0
    transfer_timeout_s: float = 10.0
    transfer_retries: int = 2
    heartbeat_ttl_s: float = 10.0


def check_role(llm: LLM, role: str) -> None:
    """``ConfigError`` unless ``llm`` can serve ``role``, naming why and what to change."""
    if role not in ROLES:
        raise ConfigError(f"--role must be one of {', '.join(ROLES)}; got {role!r}")
    if role == "both":
        return
    settings = llm.settings
    if "generate" not in llm.tasks:
        raise ConfigError(f"--role {role}: this model does not generate (it serves {', '.join(llm.tasks)}); serve it with --role both")
    if llm.deployment.decoder_start_token_id is not None:
        raise ConfigError(f"--role {role}: an encoder-decoder's decoder reads its encoder's output, which workers do not hand "
                          f"over yet; serve it with --role both")
    if not settings.kv_cache.prefix_caching:
        raise ConfigError(f"--role {role} hands prompts over through the prefix cache; drop kv_cache.prefix_caching=false")
    if llm.workers is not None:
        raise ConfigError(f"--role {role}: a worker runs on one rank (its KV blocks are handed over whole); deploy each worker "
                          f"without tensor or pipeline parallelism")
    if settings.speculative.method in ("eagle3", "mtp"):
        raise ConfigError(f"--role {role}: a {settings.speculative.method} head reads the prompt's hidden states, which are "
                          f"not handed over; serve it with --role both, or use speculative.method=draft")


def model_fingerprint(llm: LLM) -> str:
    """A digest of what two workers must share to exchange KV blocks: the model's config, a sample of its weights, the
    dtype, the KV layout and the vocabulary."""
    engine = llm.engine
    digest = hashlib.blake2b(digest_size=8)
    directory = llm.deployment.model_directory
    config = Path(directory, "config.json") if directory else None
    if config is not None and config.is_file():
        digest.update(config.read_bytes())
    digest.update(repr((str(llm.settings.dtype), engine.vocab_size, engine.handoff.layout)).encode())
    weights = sorted(llm.deployment.graph.state_dict().items())
    for _, tensor in weights[:3] + weights[-3:]:
        digest.update(tensor.detach().flatten()[:64].float().cpu().numpy().tobytes())
    return digest.hexdigest()


class DisaggWorker:
    """The role of one server (see the module docstring); ``close`` stops its services and leaves the registry."""

    def __init__(self, llm: LLM, options: WorkerOptions):
        check_role(llm, options.role)
        try:  # here, not at the top: a plain server needs no gRPC
            from autodeploy.serve.disagg import transfer
        except ImportError as error:
            raise ConfigError(f"--role {options.role} needs the disagg extra ({error.name} is missing): "
                              f"pip install 'autodeploy[disagg]'") from None
        self._transfer = transfer
        self.llm = llm
        self.options = options
        self.role = options.role
        self.engine = llm.engine
        self.handoff = self.engine.handoff
        self.fingerprint = model_fingerprint(llm)
        self.worker_id = f"{options.role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._transfer_server = None
        self.kv_address = None
        if self.role in ("prefill", "both"):
            service = transfer.KVTransferService(self.handoff, self.fingerprint)
            self._transfer_server, port = transfer.start_transfer_server(service, options.kv_host, options.kv_port)
            # what decode workers dial: the advertised URL's host (a worker listening on 0.0.0.0 is reached at that)
            self.kv_address = f"{urlsplit(options.url).hostname or options.kv_host}:{port}"
        self._reaper = threading.Thread(target=self._expire_holds, name="kv-hold-reaper", daemon=True)
        self._reaper.start()
        self._registration = None
        if options.etcd:
            from autodeploy.serve.disagg.registry import EtcdRegistry, WorkerInfo

            registry = EtcdRegistry(options.etcd, options.namespace, ttl_s=options.heartbeat_ttl_s)
            registry.check()
            self._registration = registry.register(WorkerInfo(self.worker_id, self.role, options.url, self.fingerprint), self.load)
        self.transfers = {"received_blocks": 0, "cached_blocks": 0, "failed": 0, "bytes": 0, "seconds": 0.0}

    def info(self) -> dict:
        return {"worker_id": self.worker_id, "role": self.role, "url": self.options.url, "fingerprint": self.fingerprint,
                "kv_address": self.kv_address, "load": self.load(), "transfers": dict(self.transfers)}

    def load(self) -> dict:
        """What the router balances by: prompt tokens waiting, the KV pool's use, sequences running."""
        return {**self.engine.load(), "held_transfers": self.handoff.held}

    # ---- the prefill phase ---------------------------------------------------------------------
    def hold(self, requests: Sequence[EngineRequest]) -> list[dict]:
        """Hold each finished prefill request's blocks; the list the router hands the decode worker."""
        transfers = []
        for request in requests:
            transfer_id = uuid.uuid4().hex
            keys = self.handoff.hold(transfer_id, request.prompt_token_ids, request.content_spans, ttl_s=self.options.hold_ttl_s)
            transfers.append({"source": self.kv_address, "transfer_id": transfer_id, "keys": [key.hex() for key in keys],
                              "fingerprint": self.fingerprint})
        return transfers

    # ---- the decode phase ----------------------------------------------------------------------
    def receive(self, header: str, num_prompts: int) -> list[str]:
        """Pull each prompt's blocks named by the ``x-autodeploy-kv`` header; returns the holders to ``release`` once the
        requests are done. A failed pull leaves the prompt to be computed here (``transfer.receive``)."""
        transfers = _parse_transfers(header, num_prompts)
        for transfer in transfers:  # all checked before any block is taken
            if transfer["fingerprint"] != self.fingerprint:
                raise TransferError(f"the prefill worker serves model/KV layout {transfer['fingerprint']}, this decode worker "
                                    f"{self.fingerprint}: pair workers started from the same model and settings")
        holders = []
        for transfer in transfers:
            holder = uuid.uuid4().hex
            received = self._transfer.receive(self.handoff, holder, transfer["source"], transfer["transfer_id"], transfer["keys"],
                                              self.fingerprint, self.options.transfer_timeout_s, self.options.transfer_retries,
                                              same_node=_local(transfer["source"]))
            holders.append(holder)
            self.transfers["received_blocks"] += received.written
            self.transfers["cached_blocks"] += received.cached
            self.transfers["bytes"] += received.bytes
            self.transfers["seconds"] += received.seconds
            if received.error is not None:
                self.transfers["failed"] += 1
                logger.warning("KV transfer %s from %s: %s; %d of %d blocks usable, the rest is computed here",
                               transfer["transfer_id"], transfer["source"], received.error, received.usable, received.num_blocks)
        return holders

    def release(self, holders: Sequence[str]) -> None:
        for holder in holders:
            self.handoff.release(holder)

    def close(self) -> None:
        self._stop.set()
        if self._registration is not None:
            self._registration.close()
        if self._transfer_server is not None:
            self._transfer_server.stop(grace=1)

    def _expire_holds(self) -> None:
        while not self._stop.wait(1.0):
            for holder in self.handoff.expire():
                logger.warning("KV hold %s expired: no decode worker released it within %.0f s", holder, self.options.hold_ttl_s)


def resume_requests(header: str, requests: Sequence[EngineRequest]) -> tuple[list[int], str]:
    """Start a single request's completion with the tokens another worker streamed (``x-autodeploy-resume``); returns
    them and their text. Only a one-prompt, one-sample request without beam search resumes."""
    resume = _json(header, RESUME_HEADER)
    if not isinstance(resume, Mapping) or not isinstance(resume.get("token_ids"), list) or not isinstance(resume.get("text"), str):
        raise InvalidRequestError(f'{RESUME_HEADER} must be {{"token_ids": [ids], "text": "..."}}')
    if len(requests) != 1 or requests[0].params.n != 1 or requests[0].beam_search is not None:
        raise InvalidRequestError("only a request of one prompt and one sample (n=1, no beam search) can be resumed")
    tokens = [int(token) for token in resume["token_ids"]]
    request = requests[0]
    if len(tokens) >= request.params.max_tokens:
        raise InvalidRequestError(f"the request to resume has {len(tokens)} of its max_tokens={request.params.max_tokens} already")
    sequence = request.sequences[0]
    sequence.token_ids.extend(tokens)
    sequence.streamed_tokens = len(tokens)
    sequence.streamed_text = resume["text"]
    if request.params.logprobs is not None:  # the streamed tokens' entries went out; the new ones follow them
        sequence.logprobs.extend([0.0] * len(tokens))
        sequence.top_logprobs.extend({} for _ in tokens)
    return tokens, resume["text"]


def _parse_transfers(header: str, num_prompts: int) -> list[dict]:
    """The header's transfers, their keys as bytes (``InvalidRequestError`` for anything else)."""
    transfers = _json(header, KV_HEADER)
    fields = ("source", "transfer_id", "keys", "fingerprint")
    problem = f"{KV_HEADER} must list one transfer per prompt ({num_prompts}), each with {', '.join(fields)} (keys: hex strings)"
    if (not isinstance(transfers, list) or len(transfers) != num_prompts
            or not all(isinstance(t, Mapping) and all(f in t for f in fields) and isinstance(t["keys"], list) for t in transfers)):
        raise InvalidRequestError(problem)
    try:
        return [{**transfer, "keys": [bytes.fromhex(key) for key in transfer["keys"]]} for transfer in transfers]
    except (TypeError, ValueError):
        raise InvalidRequestError(problem) from None


def _json(header: str, name: str):
    try:
        return json.loads(header)
    except ValueError:
        raise InvalidRequestError(f"{name} is not JSON: {header[:80]!r}") from None


def _local(address: str) -> bool:
    """Whether a ``host:port`` is on this node (its payloads can come through shared memory)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1", socket.gethostname()):
        return True
    try:
        return socket.gethostbyname(host) in ("127.0.0.1", socket.gethostbyname(socket.gethostname()))
    except OSError:
        return False
