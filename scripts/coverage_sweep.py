"""Coverage sweep: every model type in transformers' causal-LM mapping, as a tiny random checkpoint,
deployed through the default pipeline on the CPU and classified:

- exact:   deployed; logits within the float32 verification tolerance of HF eager (max |Δ| / max |logit|
           over batches (1,1), (2,9), (3,17)) and greedy decoding token-identical for 8 tokens;
- refused: a typed autodeploy error (its message names what is unsupported);
- wrong:   deployed but different from HF, or a raw exception instead of a typed error;
- n/a:     transformers itself cannot build or run the tiny config (nothing to compare with).

Each model type runs in a forked child (a crash or hang is that entry's result, after --timeout seconds).

    python scripts/coverage_sweep.py                 # all, writes notes/coverage.md and notes/coverage.json
    python scripts/coverage_sweep.py llama bloom     # some, printed only
    python scripts/coverage_sweep.py --merge gemma3  # some, their entries replaced in notes/coverage.*
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_INTERPRET", "1")

from autodeploy import autodeploy  # noqa: E402
from tests.sweep_models import family, sweep_model_types, sweep_one  # noqa: E402

def _child(model_type: str, connection) -> None:
    try:
        connection.send(sweep_one(model_type, lambda: connection.send(REACHED_AUTODEPLOY)))
    except BaseException as error:  # the sweep records it; the parent must not lose the entry
        connection.send({"model_type": model_type, "family": family(model_type), "status": "wrong",
                         "detail": f"sweep child raised {type(error).__name__}: {error}"})


REACHED_AUTODEPLOY = "reached autodeploy"


def _died(model_type: str, exit_code: int, reached_autodeploy: bool) -> dict:
    entry = {"model_type": model_type, "family": family(model_type)}
    if not reached_autodeploy:  # e.g. killed for memory building a multimodal model's default-size vision tower
        return {**entry, "status": "n/a", "detail": f"transformers died building or running the tiny model (exit code {exit_code})"}
    return {**entry, "status": "wrong", "detail": f"the sweep child died in autodeploy (exit code {exit_code})"}


def _received(connection) -> dict | str | None:
    """The child's next message (its result, or REACHED_AUTODEPLOY); None while it works or once it died."""
    try:
        return connection.recv() if connection.poll(0.05) else None
    except EOFError:
        return None


def run_sweep(model_types: list[str], jobs: int, timeout: float) -> list[dict]:
    context = multiprocessing.get_context("fork")
    pending, running, results, reached = list(model_types), [], [], set()
    while pending or running:
        while pending and len(running) < jobs:
            model_type = pending.pop(0)
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(model_type, send), daemon=True)
            process.start()
            running.append((model_type, process, receive, time.monotonic()))
        for item in list(running):
            model_type, process, receive, started = item
            result = _received(receive)
            if result == REACHED_AUTODEPLOY:
                reached.add(model_type)
                result = None
            if result is None and not process.is_alive():  # it may have sent just before exiting
                result = _received(receive) or _died(model_type, process.exitcode, model_type in reached)
            elif result is None and time.monotonic() - started > timeout:
                process.kill()
                if model_type in reached:
                    result = {"model_type": model_type, "family": family(model_type), "status": "wrong",
                              "detail": f"autodeploy gave no result within {timeout:.0f}s (hang?)"}
                else:
                    result = {"model_type": model_type, "family": family(model_type), "status": "n/a",
                              "detail": f"transformers did not build and run the tiny model within {timeout:.0f}s"}
            if result is not None:
                process.join(5)
                running.remove(item)
                results.append(result)
                print(f"{result['model_type']:28} {result['status']:8} {result.get('detail', result.get('verify', ''))[:150]}", flush=True)
    return sorted(results, key=lambda r: r["model_type"])


def markdown(results: list[dict]) -> str:
    decoders = [r for r in results if r["family"] == "decoder" and r["status"] != "n/a"]
    counts = {s: sum(1 for r in decoders if r["status"] == s) for s in ("exact", "refused", "wrong")}
    others = [r for r in results if r["family"] != "decoder"]
    lines = [
        f"Decoder-only text LMs that transformers builds and runs as a tiny config: {len(decoders)} — "
        f"**{counts['exact']} exact ({100 * counts['exact'] / max(len(decoders), 1):.0f}%), {counts['refused']} refused, "
        f"{counts['wrong']} wrong**. Other causal-LM classes (encoder-decoder, bidirectional encoders, multimodal): "
        f"{len(others)}, of which {sum(1 for r in others if r['status'] == 'refused')} refused, "
        f"{sum(1 for r in others if r['status'] == 'exact')} exact, {sum(1 for r in others if r['status'] == 'wrong')} wrong, "
        f"{sum(1 for r in others if r['status'] == 'n/a')} n/a.",
        "",
        "| model type | family | result | relative logit error | greedy | deploy (s) | verify (s) | detail |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        error = f"{r['relative_error']:.1e}" if "relative_error" in r else ""
        greedy = {True: "identical", False: "differs"}.get(r.get("greedy_identical"), "")
        seconds = f"{r['seconds']:.1f}" if "seconds" in r else ""
        verify = f"{r['verify_seconds']:.2f}" if r.get("verify_seconds") is not None else ""
        detail = r.get("detail", "").replace("|", "\\|")
        lines.append(f"| {r['model_type']} | {r['family']} | {r['status']} | {error} | {greedy} | {seconds} | {verify} | {detail} |")
    return "\n".join(lines) + "\n"


def _trace_patterns_in_parent() -> None:
    """Deploy one tiny model before forking, so every child inherits the traced search patterns."""
    from tests.tiny_models import write_tiny_checkpoint

    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as directory:
        write_tiny_checkpoint("llama", Path(directory))
        autodeploy(directory, device="cpu")


def packaged_table(results: list[dict]) -> str:
    """The sweep's verdicts as ``autodeploy check`` reads them (``autodeploy/assets/coverage.json``): by model type, its
    family, status and, when not exact, the first 300 characters of why."""
    table = {r["model_type"]: {"family": r["family"], "status": r["status"],
                               **({"detail": " ".join((r.get("detail") or "").split())[:300]} if r["status"] != "exact" else {})}
             for r in results}
    return json.dumps(table, indent=0, sort_keys=True) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="*", help="model types to sweep (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--merge", action="store_true", help="replace the named types' entries in notes/coverage.*")
    args = parser.parse_args()
    _trace_patterns_in_parent()
    results = run_sweep(args.model_types or sweep_model_types(), args.jobs, args.timeout)
    if args.merge:  # the named types swept again, the others' entries as the last full sweep left them
        swept = {r["model_type"] for r in results}
        kept = [r for r in json.loads((ROOT / "notes" / "coverage.json").read_text()) if r["model_type"] not in swept]
        results = sorted([*kept, *results], key=lambda r: r["model_type"])
    if not args.model_types or args.merge:
        (ROOT / "notes" / "coverage.json").write_text(json.dumps(results, indent=1) + "\n")
        (ROOT / "autodeploy" / "assets" / "coverage.json").write_text(packaged_table(results))
        (ROOT / "notes" / "coverage.md").write_text(HEADER + markdown(results))
    else:
        print(markdown(results))


HEADER = """# Architecture coverage sweep

`python scripts/coverage_sweep.py` (2-core CPU; torch and transformers versions in `notes/coverage.json`'s
neighbour, docs/trust.md). Every model type in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` as a tiny random
checkpoint (`tests/sweep_models.py`), deployed with the default pipeline (build-time verification on) on the CPU in
float32, compared with HF eager attention; the served vision-language families (Gemma 3, LLaVA with CLIP and with
SigLIP towers) as `tests/tiny_vision_models.py` builds them, their greedy tokens compared with one and with two images;
the encoder–decoders (`… (seq2seq)`: BART, mBART, T5 v1.0 and v1.1) as `tests/tiny_seq2seq_models.py` builds them, their
logit error the build's verification's, their greedy tokens compared with Hugging Face's `generate` for three inputs.
*exact*: relative logit error ≤ 1e-4 and 8 greedy tokens identical;
*refused*: a typed error; *wrong*: served differently or a raw exception; *n/a*: transformers cannot run the tiny config.

"""

if __name__ == "__main__":
    main()
