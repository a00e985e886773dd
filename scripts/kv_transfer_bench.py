"""KV transfer rate on one node (issue 46): a prompt's blocks pulled from a prefill engine into a decode engine over the
gRPC ``KVTransfer`` service, through shared memory and inline, against a device-to-device copy of the same bytes
measured in the same run.

Both engines live in this process (the sender's service answers on loopback from its own threads), so the figure is
the transfer path's: gather → host → shared memory (or the socket) → host → device → scatter, gRPC and checksums
included. The deployment's weights are random (``--set weights=random`` for a named config).

    python3 scripts/kv_transfer_bench.py --model llama-3-8b --set weights=random --tokens 1024,4096 --out kv.json
    python3 scripts/kv_transfer_bench.py --model /tmp/tiny-llama --set device=cpu          # the path on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from autodeploy import autodeploy
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.serve.disagg.transfer import KVTransferService, receive, start_transfer_server


def _copy_rate(num_bytes: int, device: torch.device, repeats: int) -> float:
    """Bytes/s of one copy of ``num_bytes`` within ``device`` (device to device on a GPU)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return num_bytes / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--tokens", default="1024", help="prompt lengths (comma list)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=1024, help="each engine's KV pool (kv_cache.num_blocks)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sets = [*args.sets, f"kv_cache.num_blocks={args.blocks}"]
    sender = autodeploy(args.model, set_arguments=sets).engine
    receiver = autodeploy(args.model, set_arguments=sets).engine
    server, port = start_transfer_server(KVTransferService(sender.handoff, "bench"), "127.0.0.1", 0)
    rows = []
    try:
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            prompt = [(7 * i + 3) % (sender.vocab_size - 10) + 5 for i in range(num_tokens)]
            request = sender.add_request(prompt, SamplingParams(max_tokens=1))
            while not request.finished:
                sender.step()
            for same_node in (True, False):
                seconds, received = [], None
                for repeat in range(args.repeats):
                    receiver.pool.reset_prefix_cache()
                    keys = sender.handoff.hold(f"t{repeat}", prompt)
                    received = receive(receiver.handoff, f"r{repeat}", f"127.0.0.1:{port}", f"t{repeat}", keys, "bench",
                                       timeout_s=60, same_node=same_node)
                    receiver.handoff.release(f"r{repeat}")
                    assert received.error is None and received.usable == len(keys), received
                    if receiver.device.type == "cuda":
                        torch.cuda.synchronize(receiver.device)
                    seconds.append(received.seconds)
                median = statistics.median(seconds[1:] if len(seconds) > 1 else seconds)
                copy = _copy_rate(received.bytes, receiver.device, args.repeats)
                rows.append({"tokens": num_tokens, "blocks": received.num_blocks, "bytes": received.bytes,
                             "path": "shared memory" if received.shared_memory else "inline (socket)",
                             "seconds": median, "bytes_per_s": received.bytes / median, "copy_bytes_per_s": copy,
                             "of_copy": received.bytes / median / copy})
                row = rows[-1]
                print(f"{num_tokens:>6} tokens  {row['blocks']:>4} blocks  {row['bytes'] / 2**20:8.1f} MiB  {row['path']:<16} "
                      f"{row['seconds'] * 1e3:8.2f} ms  {row['bytes_per_s'] / 2**30:6.2f} GiB/s  "
                      f"(copy on {receiver.device.type}: {copy / 2**30:7.1f} GiB/s, {row['of_copy']:.4f}×)", flush=True)
            sender.pool.reset_prefix_cache()
    finally:
        server.stop(grace=0)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"device": device, "model": args.model, "sets": sets, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
