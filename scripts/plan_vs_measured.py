"""Issue 47's figures on the GPU: the planner's predictions against measurements, and its choice against a sweep.

``predict``: for each scheme, ``autodeploy bench`` measures decode tok/s at batch 1, 8, 32, 64, 128 and 256 (128 in /
128 out) and the peak device memory on the Llama-3-8B shape with random weights; the memory model and the speed model
the planner uses on this device (``calibrated``: its shipped fit, else the defaults) predict the same points (target:
within 15%). A model refitted on batch 1, 32 and 256 alone (``fit_scheme_speed``) then predicts the held-out batches 8,
64 and 128; it is saved as this device's calibration and written to ``$OUT/speed_models.json`` (to ship in
``autodeploy/assets/``). ``sweep``: output tok/s at 256 concurrent requests under hand-picked
settings and under the plan's (``autodeploy plan``), the best against the plan's (target: the plan within 10%).

    python3 scripts/plan_vs_measured.py --stage predict --out /tmp/o   # ~6 min on an H100 (three builds, 18 points)
    python3 scripts/plan_vs_measured.py --stage sweep --out /tmp/o     # ~5 min: seven builds at 256 concurrent
    (both stages took 544 s in one call with three batches a scheme on the H100, 2026-12-08: two calls now)
    python3 scripts/plan_vs_measured.py --stage predict --schemes none --batches 1,8 --model /tmp/tiny --device-profile cpu
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from autodeploy.models.factory import ModelFactory
from autodeploy.models.source import resolve_model_source
from autodeploy.planning import PlanRequest, SpeedModel, current_profile, plan, profile
from autodeploy.planning.check import model_shape
from autodeploy.planning.estimate import Quantization, calibrated, fit_scheme_speed, memory_use, save_calibration, step_cost

CONTEXT = 192  # a decode step's mean context: 128 prompt tokens and half of 128 outputs

SWEEP = [  # (max_batch_size, scheduler.max_num_tokens, quantize.default)
    (128, 2048, "none"), (256, 2048, "none"), (256, 8192, "none"), (128, 2048, "fp8"), (256, 2048, "fp8"), (256, 8192, "fp8"),
]


def _bench(model: str, out: Path, sets: list[str], workload: list[str], timeout: int) -> dict:
    command = [sys.executable, "-m", "autodeploy", "bench", model, "--set", "weights=random", *[a for s in sets for a in ("--set", s)],
               *workload, "--repeats", "1", "--no-progress", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=None)
    if result.returncode != 0:
        print(result.stdout[-2000:], result.stderr[-2000:])
        return {}
    return json.loads(out.read_text())


def predict(args, shape, device) -> None:
    speed = calibrated(device.base_name)  # what the planner uses on this device: its shipped fit, else the defaults
    fit_batches = {int(b) for b in args.fit_batches.split(",")}
    rows, measured_steps = [], {}
    for scheme in args.schemes.split(","):
        quantization = Quantization.of(scheme)
        result = _bench(args.model, args.out / f"predict_{scheme}.json", [f"quantize.default={scheme}", *args.set],
                        ["--workload", "synthetic", "--batch", args.batches, "--input-len", "128", "--output-len", "128"], 540)
        for run in result.get("runs", []):
            batch = run["workload"]["batch"]
            metrics = run["metrics"]
            tpot = metrics["tpot_s"]["p50"]
            measured = 1 / tpot * batch if tpot else metrics["output_tokens_per_s"]
            peak = metrics.get("peak_device_memory_bytes")
            memory = memory_use(shape, device, dtype_bytes=2, quantization=quantization, kv_dtype_bytes=2, max_seq_len=8192,
                                max_batch_size=32, max_num_tokens=2048)
            predicted_peak = memory.weights + memory.activations + memory.graphs + memory.workspace + memory.kv_budget
            rows.append({"scheme": scheme, "batch": batch, "measured": measured, "peak": peak, "peak_predicted": predicted_peak,
                         "predicted": speed.decode_tokens_per_s(shape, device, batch, CONTEXT, dtype_bytes=2, quantization=quantization)})
            measured_steps.setdefault(scheme, []).append((batch, batch / measured))
    # Fitted on the fit batches only: the other batches are predictions it never saw (held out).
    fitted = {scheme: fit_scheme_speed([(b, step_cost(shape, device, b, CONTEXT, dtype_bytes=2, quantization=Quantization.of(scheme)), m)
                                        for b, m in points if b in fit_batches], speed.scheme(scheme), speed.step_overhead_s)
              for scheme, points in measured_steps.items() if len([b for b, _ in points if b in fit_batches]) >= 3}
    refit = SpeedModel(fitted, speed.step_overhead_s, speed.allreduce_s,
                       f"fitted on {device.description} (scripts/plan_vs_measured.py; Llama-3-8B shape, batch "
                       f"{', '.join(map(str, sorted(fit_batches)))}, 128 in / 128 out)")
    print(f"speed model used: {speed.source}")
    print(f"{'scheme':<10}{'batch':>6}{'measured':>10}{'predicted':>11}{'error':>8}{'refit':>10}{'error':>8}{'':>11}"
          f"{'peak pred GiB':>15}{'measured':>10}")
    for row in rows:
        quantization = Quantization.of(row["scheme"])
        row["refit"] = refit.decode_tokens_per_s(shape, device, row["batch"], CONTEXT, dtype_bytes=2, quantization=quantization) \
            if row["scheme"] in fitted else None
        held = "fit point" if row["batch"] in fit_batches else "held out"
        refit_text = f"{row['refit']:>10,.1f}{row['refit'] / row['measured'] - 1:>+8.1%}" if row["refit"] else f"{'-':>10}{'':>8}"
        peak_text = f"{row['peak'] / 2**30:10.1f}" if row["peak"] else "         -"
        print(f"{row['scheme']:<10}{row['batch']:>6}{row['measured']:>10,.1f}{row['predicted']:>11,.1f}"
              f"{row['predicted'] / row['measured'] - 1:>+8.1%}{refit_text}{held:>11}{row['peak_predicted'] / 2**30:>15.1f}{peak_text}")
    if fitted:  # the device's model from now on, and the file to ship for its profile (autodeploy/assets/speed_models.json)
        print("saved to", save_calibration(device.base_name, refit))
        print("to ship:", save_calibration(device.base_name, refit, args.out / "speed_models.json"))
    (args.out / "predict.json").write_text(json.dumps({"device": device.name, "rows": rows, "fitted": refit.to_json()}, indent=1))


def sweep(args, shape, device) -> None:
    chosen = plan(shape, device, PlanRequest(context=2048, concurrency=256, weights="random"))
    settings = [(chosen.value("max_batch_size"), chosen.value("scheduler.max_num_tokens"), chosen.value("quantize.default"), "plan")]
    settings += [(*entry, "hand") for entry in SWEEP]
    results = []
    for batch, tokens, scheme, origin in settings:
        sets = [f"max_batch_size={batch}", f"scheduler.max_num_tokens={tokens}", f"quantize.default={scheme}", "max_seq_len=2048", *args.set]
        result = _bench(args.model, args.out / f"sweep_{origin}_{batch}_{tokens}_{scheme}.json", sets,
                        ["--workload", "concurrency", "--concurrency", "256", "--num-requests", "1024", "--input-dist", "fixed:128",
                         "--output-dist", "fixed:128"], 420)
        rate = result["runs"][0]["metrics"]["output_tokens_per_s"] if result.get("runs") else None
        results.append((origin, batch, tokens, scheme, rate))
        print(f"{origin:<5} max_batch_size {batch:>4} max_num_tokens {tokens:>5} quantize {scheme:<9} "
              f"{'failed' if rate is None else f'{rate:,.0f} output tok/s'}", flush=True)
    measured = [r for r in results if r[4]]
    if measured and results[0][4]:
        best = max(measured, key=lambda r: r[4])
        print(f"plan {results[0][4]:,.0f} against the best {best[4]:,.0f} ({best[:4]}): {results[0][4] / best[4]:.3f}× (target ≥ 0.90)")
    (args.out / "sweep.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--stage", default="predict,sweep")
    parser.add_argument("--schemes", default="none,fp8,int4_wo")
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--fit-batches", default="1,32,256", help="the batches the refit sees; the others are held out")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--device-profile", default=None, help="default: the GPU this process sees")
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shape = model_shape(ModelFactory.from_source(resolve_model_source(args.model, "random")))
    device = profile(args.device_profile) if args.device_profile else current_profile(torch.device("cuda"))[0]
    if "predict" in args.stage:
        predict(args, shape, device)
    if "sweep" in args.stage:
        sweep(args, shape, device)


if __name__ == "__main__":
    main()
