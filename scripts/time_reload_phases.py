"""Where a reload's first half goes: the graph's deserialization and the weights' read, alone and together.

    python3 scripts/time_reload_phases.py llama-3-8b --set weights=random     # on the GPU machine
    python3 scripts/time_reload_phases.py                                      # the demo model, CPU

Builds and saves the model once, then in a fresh process per line: ``torch.export.load`` of the graph
alone; the weights file read (hashed, copied onto the devices) alone with 4, 8 and 15 reader threads; and
both at once as the reload runs them (the weights on background threads) at each thread count. For the
weights, the time until their copies are done (what the graph's assembly waits for) and until the digest
is (what serving waits for, while the engine captures its graphs). The lines alone against together say
how much of each is the branches' own work and how much their contention for the GIL (notes/perf.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_BUILD = """
import sys
from autodeploy import autodeploy
autodeploy(sys.argv[1] or None, set_arguments=sys.argv[3:]).save(sys.argv[2])
"""
_PHASES = """
import json, sys, time
from pathlib import Path
import autodeploy.custom_ops  # noqa: F401  (registers the ops the graph names)
from autodeploy.artifact import graph_archive, weights_file
from autodeploy.artifact.layout import GRAPH, SERVING, WEIGHTS
from autodeploy.artifact.load import _short_gil_turns  # as the reload runs the two branches
directory, mode, threads = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
weights_file._READ_THREADS = threads
devices = {entry["key"]: entry["device"] for entry in json.loads((directory / SERVING).read_text())["tensors"].values()}
archive = (directory / GRAPH).read_bytes()
timed = {}
def graph():
    start = time.perf_counter(); graph_archive.load_program(archive, GRAPH); timed["graph"] = time.perf_counter() - start
start = time.perf_counter()
if mode == "graph":
    graph()
else:
    with _short_gil_turns():
        reading = weights_file.start_reading(directory / WEIGHTS, devices)
        if mode == "both":
            graph()
        reading.tensors(); timed["copies"] = time.perf_counter() - start
        reading.digest(); timed["digest"] = time.perf_counter() - start
        reading.close()
timed["wall"] = time.perf_counter() - start
print(json.dumps(timed))
"""


def _run(code: str, *arguments: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *arguments], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="", help="as for `autodeploy build` (default: the demo model)")
    parser.add_argument("--set", dest="set_arguments", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        directory = str(Path(folder) / "deployment")
        started = time.perf_counter()
        _run(_BUILD, args.model, directory, *args.set_arguments)
        print(f"{args.model or 'demo'}: built and saved in {time.perf_counter() - started:.1f} s")
        _run(_PHASES, directory, "weights", "16")  # the file into the page cache, as after a save
        for mode, threads in [("graph", 16), ("weights", 4), ("weights", 8), ("weights", 16),
                              ("both", 4), ("both", 8), ("both", 16)]:
            timed = _run(_PHASES, directory, mode, str(threads))
            shown = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in timed.items())
            print(f"  {mode:7s} {threads:2d} reader threads: {shown}")


if __name__ == "__main__":
    main()
