"""KV-cache transfer over gRPC: the prefill worker's ``KVTransfer`` service and the decode worker's ``receive``.

The decode worker *pulls*: it first takes blocks for the prompt's prefix (``KVHandoff.adopt``: the blocks its prefix
cache holds are shared, the others are new), then asks the prefill worker for the payloads of the new ones only.
Each block comes with its prefix-cache key and a CRC-32; a block whose key or checksum is wrong, or that never
arrives, is asked for again (``retries`` more times), and what is still missing is left out: only the leading run of
blocks that arrived whole enters the decode worker's prefix cache, and its request computes the rest of the prompt
itself. So a transfer that fails (a dead prefill worker, a deadline, corruption) costs compute, never a wrong
token. When the receiver is on the same node, the payloads travel through a shared-memory segment it made (the
messages carry offsets), not through the socket; the sender falls back to inline payloads when it cannot open it.
The sender frees its hold when the receiver says ``Release``, or when the hold expires (``KVHandoff.expire``).

Both ends name their model and KV layout by a fingerprint (``worker.py``); a sender refuses a receiver whose
fingerprint differs (``FAILED_PRECONDITION``, naming both).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import zlib
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from multiprocessing import shared_memory

import grpc

from autodeploy.errors import TransferError
from autodeploy.runtime.kv_handoff import KVHandoff
from autodeploy.serve.disagg import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

_SERVICE = "autodeploy.disagg.KVTransfer"
# Below this, a segment's making and unlinking cost more than the socket's copies (measured on a CPU: 3 blocks of 8 KiB
# took 4.2 ms through shared memory, 1.7 ms inline; notes/disaggregated.md).
SHARED_MEMORY_MIN_BYTES = 1 << 20
# A test hook: the sender corrupts the first N payloads it sends (tests/serve/test_disagg.py), as a bad link would.
CORRUPT_ENV = "AUTODEPLOY_FAULT_CORRUPT_KV_BLOCKS"


@dataclass
class Received:
    """What ``receive`` got: ``cached`` blocks the receiver had, ``written`` blocks that arrived whole, ``usable`` the
    leading run of both that the request will find in the prefix cache, out of ``num_blocks``."""

    num_blocks: int
    cached: int = 0
    written: int = 0
    usable: int = 0
    attempts: int = 0
    bytes: int = 0
    seconds: float = 0.0  # from asking for blocks to having written them
    shared_memory: bool = False
    error: str | None = None


# ---- the sender (prefill worker) ---------------------------------------------------------------
class KVTransferService:
    """Serves held prompts' blocks (``KVHandoff.hold``) to decode workers."""

    def __init__(self, handoff: KVHandoff, fingerprint: str):
        self.handoff = handoff
        self.fingerprint = fingerprint
        self._corrupt = int(os.environ.get(CORRUPT_ENV, "0"))

    def pull(self, request: pb.PullRequest, context: grpc.ServicerContext):
        if request.fingerprint != self.fingerprint:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this prefill worker serves model/KV layout {self.fingerprint}, the decode worker {request.fingerprint}: "
                          f"pair workers started from the same model, dtype and KV-cache settings")
        try:
            blocks = list(self.handoff.payloads(request.transfer_id, set(request.skip)))
        except KeyError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"transfer {request.transfer_id!r} is not held here: it was released, or "
                                                     f"its hold expired")
        keys = self.handoff.keys(request.transfer_id)
        layout = self.handoff.layout
        yield pb.PullReply(header=pb.Header(fingerprint=self.fingerprint, num_blocks=len(blocks), block_bytes=layout.block_bytes,
                                            layout=layout.describe()))
        segment = _open_segment(request.shared_memory) if request.shared_memory else None
        try:
            for position, (index, payload) in enumerate(blocks):
                checksum = zlib.crc32(payload)
                if self._corrupt > 0:
                    self._corrupt -= 1
                    payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
                if segment is not None:
                    offset = position * len(payload)
                    segment[offset: offset + len(payload)] = payload
                    yield pb.PullReply(block=pb.Block(index=index, key=keys[index], crc32=checksum, offset=offset))
                else:
                    yield pb.PullReply(block=pb.Block(index=index, key=keys[index], payload=payload, crc32=checksum))
        finally:
            if segment is not None:
                segment.close()

    def release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        return pb.ReleaseReply(released=self.handoff.release(request.transfer_id))

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(_SERVICE, {
            "Pull": grpc.unary_stream_rpc_method_handler(self.pull, pb.PullRequest.FromString, pb.PullReply.SerializeToString),
            "Release": grpc.unary_unary_rpc_method_handler(self.release, pb.ReleaseRequest.FromString,
                                                           pb.ReleaseReply.SerializeToString),
        })


def start_transfer_server(service: KVTransferService, host: str, port: int) -> tuple[grpc.Server, int]:
    """The gRPC server of ``service`` on ``host:port`` (0: a free port); returns it and its port."""
    # so_reuseport off: a second worker given the same --kv-port fails to start, instead of sharing the port's connections
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-transfer"),
                         options=[*_MESSAGE_OPTIONS, ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((service.handler(),))
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise TransferError(f"the KV transfer server cannot listen on {host}:{port} (in use?); pick another --kv-port")
    server.start()
    return server, bound


# ---- the receiver (decode worker) --------------------------------------------------------------
def receive(handoff: KVHandoff, holder: str, source: str, transfer_id: str, keys: Sequence[bytes], fingerprint: str,
            timeout_s: float = 10.0, retries: int = 2, same_node: bool = False) -> Received:
    """Adopt the prefix ``keys`` under ``holder`` and fill its new blocks from ``source`` (``host:port`` of a prefill
    worker holding ``transfer_id``); then tell the source to release its hold. Never raises for a failed transfer
    (``Received.error`` says what failed; the request computes what is missing) — only ``TransferError`` when the
    source refuses this worker's fingerprint, which no retry mends."""
    result = Received(num_blocks=len(keys))
    started = time.perf_counter()
    new = handoff.adopt(holder, keys)
    if new is None:
        result.error = "no free KV blocks to receive into"
        return result
    result.cached = len(keys) - len(new)
    payloads: dict[int, bytes] = {}
    channel = _channel(source)
    pull = channel.unary_stream(f"/{_SERVICE}/Pull", pb.PullRequest.SerializeToString, pb.PullReply.FromString)
    release = channel.unary_unary(f"/{_SERVICE}/Release", pb.ReleaseRequest.SerializeToString, pb.ReleaseReply.FromString)
    wanted = set(new)
    while wanted and result.attempts <= retries:
        result.attempts += 1
        try:
            shared = same_node and len(wanted) * handoff.layout.block_bytes >= SHARED_MEMORY_MIN_BYTES
            got = _pull(pull, transfer_id, fingerprint, keys, wanted, handoff.layout.block_bytes, timeout_s, shared, result)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                handoff.release(holder)
                raise TransferError(error.details()) from None
            result.error = f"{error.code().name}: {error.details()}"
            if error.code() == grpc.StatusCode.NOT_FOUND:
                break
            continue
        payloads.update(got)
        wanted -= set(got)
        if wanted:
            result.error = f"{len(wanted)} block(s) failed their checksum or did not arrive"
    # Not waited for (a round trip off the request's path); one that fails leaves a hold that expires by itself.
    release.future(pb.ReleaseRequest(transfer_id=transfer_id), timeout=timeout_s).add_done_callback(
        lambda call: call.exception() is not None and logger.warning("could not release transfer %s at %s: %s", transfer_id,
                                                                     source, call.exception()))
    result.written = len(payloads)
    result.usable = handoff.write(holder, keys, payloads)
    result.seconds = time.perf_counter() - started
    if not wanted:
        result.error = None
    return result


def _pull(pull, transfer_id: str, fingerprint: str, keys: Sequence[bytes], wanted: set[int], block_bytes: int,
          timeout_s: float, same_node: bool, result: Received) -> dict[int, bytes]:
    """One ``Pull`` of the ``wanted`` blocks: the payloads that arrived whole, by index."""
    skip = [key for index, key in enumerate(keys) if index not in wanted]
    segment = shared_memory.SharedMemory(create=True, size=max(1, len(wanted) * block_bytes)) if same_node else None
    got: dict[int, bytes] = {}
    try:
        replies = pull(pb.PullRequest(transfer_id=transfer_id, fingerprint=fingerprint, skip=skip,
                                      shared_memory=segment.name if segment else ""), timeout=timeout_s)
        for reply in replies:
            if reply.WhichOneof("item") != "block":
                continue
            block = reply.block
            payload = block.payload if block.payload or segment is None else bytes(segment.buf[block.offset: block.offset + block_bytes])
            result.shared_memory |= not block.payload
            if block.index in wanted and block.key == keys[block.index] and zlib.crc32(payload) == block.crc32:
                got[block.index] = payload
                result.bytes += len(payload)
            else:
                logger.warning("KV block %d of transfer %s failed its check; asking again", block.index, transfer_id)
    finally:
        if segment is not None:
            segment.close()
            segment.unlink()
    return got


def _open_segment(name: str) -> mmap.mmap | None:
    """The receiver's shared-memory segment, when it is on this node (None: send payloads inline). Mapped from
    /dev/shm directly: ``SharedMemory(name)`` would register it with this process's resource tracker, which unlinks it
    at exit, while the receiver made it and unlinks it."""
    try:
        descriptor = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(descriptor, 0)
    except (OSError, ValueError):
        return None
    finally:
        os.close(descriptor)


_MESSAGE_OPTIONS = [("grpc.max_send_message_length", 256 * 2**20), ("grpc.max_receive_message_length", 256 * 2**20)]
# A prefill worker that restarts at its address is reached again within a second (gRPC's default backoff grows to 2 min).
_CHANNEL_OPTIONS = [*_MESSAGE_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
_channels: dict[str, grpc.Channel] = {}
_channels_lock = threading.Lock()


def _channel(source: str) -> grpc.Channel:
    """One channel per prefill worker, kept: a connection a transfer, a TCP handshake and HTTP/2 setup each, would cost
    more than a short prompt's blocks."""
    with _channels_lock:
        if source not in _channels:
            _channels[source] = grpc.insecure_channel(source, options=_CHANNEL_OPTIONS)
        return _channels[source]
