"""Stopping the Triton server after many concurrent gRPC streams: it must exit promptly (not wait out its 30 s
exit timeout) and its Python stubs must end cleanly. A server of its own, since the test stops it."""

from __future__ import annotations

import threading
import time

from autodeploy.serve.triton.client import stream_generate
from tests.serve.test_triton_server import serve_repository

# What tritonserver and its stubs log when a shutdown is not clean: the exit timeout ran out (a model was never
# unloaded), a stub was torn down without its finalize, or a process died of a signal other than the SIGTERM
# that stops the server ("Signal (15) received.").
UNCLEAN = ("Exit timeout expired", "Non-graceful termination", "Segmentation fault", "Signal (11)", "Signal (6)", "core dumped")


def test_shutdown_after_80_concurrent_streams_is_prompt_and_clean(tmp_path, llama_dir):
    """80 streams of 64 tokens at once, each closed by the client as soon as its final response came, then
    SIGTERM. Before the client stopped cancelling finished streams, Triton 2.51's gRPC frontend kept one
    of them (and so the llm model) alive, and the server exited only at its 30 s exit timeout (5 of 5 runs)."""
    finish_reasons: list[str | None] = [None] * 80
    with serve_repository(tmp_path, llama_dir) as server:

        def client(i: int) -> None:
            pieces = list(stream_generate(server.grpc, "def fibonacci(n):", max_tokens=64, ignore_eos=True, temperature=0.0))
            finish_reasons[i] = pieces[-1].finish_reason

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(finish_reasons))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert finish_reasons == ["length"] * len(finish_reasons)
        stopping = time.monotonic()
    stopped_after = time.monotonic() - stopping
    text = (tmp_path / "tritonserver.log").read_text()
    assert not [line for line in text.splitlines() if any(mark in line for mark in UNCLEAN)], text[-3000:]
    assert stopped_after < 20, f"the server took {stopped_after:.1f} s to stop:\n{text[-3000:]}"
