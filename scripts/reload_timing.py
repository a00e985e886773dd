"""Build vs reload of a saved deployment, each in a fresh process (as ``autodeploy build`` and ``run DIR`` pay them).

    python scripts/reload_timing.py                                  # the demo model on CPU
    python scripts/reload_timing.py path/to/checkpoint --repeats 3 --set device=cpu

Per model: ``autodeploy(MODEL)`` then ``llm.save(DIR)`` in one process, ``autodeploy(DIR)`` in another (the
median of ``--repeats``). Each line gives the call's own time and the process's (imports included), then
where the last reload's time went (its phases, as ``autodeploy.artifact.load`` and the engine log them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_BUILD = """
import json, sys, time
from autodeploy import autodeploy
start = time.perf_counter()
llm = autodeploy(sys.argv[1] or None, set_arguments=sys.argv[3:])
built = time.perf_counter() - start
llm.save(sys.argv[2])
print(json.dumps({"call": built, "save": time.perf_counter() - start - built}))
"""
_RELOAD = """
import json, logging, sys, time
from autodeploy import autodeploy
phases = []
handler = logging.Handler()
handler.emit = lambda record: phases.append(record.getMessage())
for name in ("autodeploy.artifact.load", "autodeploy.runtime.engine", "autodeploy.runtime.piecewise_graphs",
             "autodeploy.runtime.cuda_graphs"):
    logging.getLogger(name).addHandler(handler)
    logging.getLogger(name).setLevel(logging.INFO)
profile = None
if len(sys.argv) > 2:  # --profile N: the call under cProfile, its N costliest functions to stderr
    import cProfile, pstats
    profile = cProfile.Profile()
    profile.enable()
start = time.perf_counter()
autodeploy(sys.argv[1])
call = time.perf_counter() - start
if profile is not None:
    profile.disable()
    stats = pstats.Stats(profile, stream=sys.stderr)
    stats.sort_stats("tottime").print_stats(int(sys.argv[2]))
    stats.sort_stats("cumulative").print_stats(int(sys.argv[2]))
print(json.dumps({"call": call, "phases": phases}))
"""


def _run(code: str, *arguments: str, show_stderr: bool = False) -> tuple[dict, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *arguments], cwd=ROOT, capture_output=True, text=True, check=True)
    if show_stderr:
        print(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1]), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="", help="as for `autodeploy build` (default: the demo model)")
    parser.add_argument("--repeats", type=int, default=3, help="reloads to take the median of")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="one more reload under cProfile, printing its N costliest functions (not timed)")
    parser.add_argument("--set", dest="set_arguments", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        directory = str(Path(folder) / "deployment")
        build, build_wall = _run(_BUILD, args.model, directory, *args.set_arguments)
        reloads = [_run(_RELOAD, directory) for _ in range(args.repeats)]
        if args.profile:
            _run(_RELOAD, directory, str(args.profile), show_stderr=True)
    reload_call = statistics.median(r["call"] for r, _ in reloads)
    reload_wall = statistics.median(wall for _, wall in reloads)
    print(f"{args.model or 'demo'}: build {build['call']:.2f}s (save {build['save']:.2f}s, process {build_wall:.1f}s); "
          f"reload {reload_call:.2f}s = {reload_call / build['call']:.0%} of the build (process {reload_wall:.1f}s = "
          f"{reload_wall / build_wall:.0%})")
    for message in reloads[-1][0]["phases"]:
        print(f"  last reload: {message}")


if __name__ == "__main__":
    main()
