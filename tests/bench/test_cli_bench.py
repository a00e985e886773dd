"""``autodeploy bench`` end to end on the tiny Llama: JSON, plots, baselines, accuracy, regression exit
code, and bad input rejected before any measurement."""

from __future__ import annotations

import json
import re

import pytest

import autodeploy.bench.benchmark as benchmark
from autodeploy.bench.metrics import RequestTiming, summarize
from autodeploy.bench.report import format_table
from autodeploy.bench.results import BenchResult, RunResult, load_result
from autodeploy.cli.main import main

FAST = ["--input-len", "8", "--output-len", "4", "--repeats", "2", "--no-progress", "--set", "device=cpu"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_writes_json_plots_ratios_and_accuracy(capsys, llama_dir, tmp_path):
    out_file, plots = tmp_path / "result.json", tmp_path / "plots"
    code, out, err = run_cli(
        capsys, "bench", str(llama_dir), "--workload", "synthetic,poisson,accuracy", "--batch", "1,2", "--rate", "50",
        "--num-requests", "4", "--input-dist", "uniform:4:12", "--output-dist", "fixed:3", "--compare", "hf-eager",
        "--out", str(out_file), "--plot", str(plots), *FAST,
    )
    assert code == 0, err
    result = load_result(out_file)
    ids = [run.id for run in result.runs]
    assert ids == [
        "synthetic/b1-in8-out4/autodeploy", "synthetic/b2-in8-out4/autodeploy",
        "poisson/rate50-n4-inuniform:4:12-outfixed:3/autodeploy",
        "synthetic/b1-in8-out4/hf-eager", "synthetic/b2-in8-out4/hf-eager",
    ]
    ours = result.runs[1]
    assert ours.metrics["output_tokens"] == 8 and len(ours.samples["output_tokens_per_s"]) == 2
    assert "output_tokens_per_s/hf-eager" in ours.ratios
    assert result.accuracy["top1_agreement"] == 1.0
    assert set(result.build["stages"]) >= {"export", "match", "cache"}
    assert "synthetic/b2-in8-out4/autodeploy" in out and "top-1 agreement 100.00%" in out
    assert re.search(r"^  synthetic/b1-in8-out4/autodeploy: output_tokens_per_s/hf-eager [0-9.]+× \((better|worse|even)\), "
                     r"e2e_p50_s/hf-eager [0-9.]+× \((better: faster|worse: slower|even)\)$", out, re.MULTILINE), out
    assert any(p.suffix == ".png" for p in plots.iterdir())


def test_a_slowed_run_against_a_faster_baseline_exits_3(capsys, llama_dir, tmp_path):
    first = tmp_path / "first.json"
    assert run_cli(capsys, "bench", str(llama_dir), "--batch", "2", "--out", str(first), *FAST)[0] == 0
    faster = json.loads(first.read_text())
    for run in faster["runs"]:  # pretend the stored baseline was three times faster
        for name, values in run["samples"].items():
            run["samples"][name] = [v * 3 if name.endswith("per_s") else v / 3 for v in values]
    baseline = tmp_path / "faster.json"
    baseline.write_text(json.dumps(faster))
    code, out, err = run_cli(capsys, "bench", str(llama_dir), "--batch", "2", "--baseline", str(baseline), *FAST)
    assert code == 3 and "regressed" in out and "regression against" in err


def test_a_single_repeat_baseline_makes_the_comparison_threshold_only(capsys, llama_dir, tmp_path):
    # A baseline recorded with --repeats 1 (and three times faster, so the verdict is not in doubt).
    run = RunResult("synthetic/b2-in8-out4/autodeploy", {}, "autodeploy", 1, {}, samples={"output_tokens_per_s": [1e6]})
    baseline = tmp_path / "once.json"
    BenchResult("", {"device_name": "test"}, "tiny", {}, {}, runs=[run]).save(baseline)
    code, out, _ = run_cli(capsys, "bench", str(llama_dir), "--batch", "2", "--baseline", str(baseline), *FAST)
    assert code == 3
    heading = out.split("\n\n")[-1].splitlines()[0]
    assert heading.startswith("threshold-only comparison (no noise estimate): the baseline recorded a single repeat"), out


def _run_with_ratios(ratios: dict[str, float]) -> RunResult:
    metrics = {**summarize([RequestTiming(0.0, [0.1, 0.2], 4)]), "peak_device_memory_bytes": None, "peak_host_rss_bytes": None}
    return RunResult("synthetic/b1-in8-out4/autodeploy", {}, "autodeploy", 2, metrics, ratios=ratios)


@pytest.mark.parametrize(
    "ratios, line",
    [
        ({"output_tokens_per_s/hf-eager": 0.73, "e2e_p50_s/hf-eager": 1.4},
         "output_tokens_per_s/hf-eager 0.73× (worse), e2e_p50_s/hf-eager 1.40× (worse: slower)"),
        ({"output_tokens_per_s/hf-eager": 1.25, "e2e_p50_s/hf-eager": 0.8},
         "output_tokens_per_s/hf-eager 1.25× (better), e2e_p50_s/hf-eager 0.80× (better: faster)"),
        ({"e2e_p50_s/hf-eager": 1.001, "output_tokens_per_s/hf-compile": 0.5, "output_tokens_per_s/hf-eager": 1.0, "ttft_p50_s/hf-eager": 2.0},
         "output_tokens_per_s/hf-compile 0.50× (worse), output_tokens_per_s/hf-eager 1.00× (even), e2e_p50_s/hf-eager 1.00× (even)"),
    ],
    ids=["slower", "faster", "even-and-two-baselines"],
)
def test_ratio_lines_say_better_or_worse_per_metric(ratios, line):
    result = BenchResult("", {"device_name": "test", "device": "cpu"}, "tiny", {}, {"total_s": 1.0, "stages": {}}, runs=[_run_with_ratios(ratios)])
    lines = format_table(result).splitlines()
    assert f"  synthetic/b1-in8-out4/autodeploy: {line}" in lines
    assert not any("> 1 means" in text for text in lines)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--workload", "poisson", "--rate", "0"], "rates must be > 0"),
        (["--workload", "poisson", "--rate", "-2"], "rates must be > 0"),
        (["--workload", "tpc-h"], "unknown workload"),
        (["--compare", "vllm"], "unknown baseline"),
        (["--output-len", "600"], "max_seq_len=512"),
        (["--workload", "poisson", "--dataset", "prompts.csv"], "unknown format"),
        (["--workload", "poisson", "--dataset", "empty.jsonl"], "is empty"),
        (["--batch", "one"], "comma-separated list of ints"),
        (["--baseline", "missing.json"], "does not exist"),
        (["--baseline", "missing.json", "--repeats", "1"], "--baseline needs --repeats 2 or more"),
        (["--workload", "accuracy", "--set", "weights=random"], "needs weights=checkpoint"),
    ],
)
def test_bad_input_fails_before_anything_runs(capsys, monkeypatch, llama_dir, tmp_path, arguments, message):
    (tmp_path / "prompts.csv").write_text("a,b\n")
    (tmp_path / "empty.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)

    def measured(*args, **kwargs):
        raise AssertionError("a measurement started before the input was checked")

    monkeypatch.setattr(benchmark, "run_workload", measured)
    code, _, err = run_cli(capsys, "bench", str(llama_dir), *FAST, *arguments)
    assert code == 1 and err.startswith("error: ") and message in err, err


def test_bench_with_speculation_measures_the_same_engine_without_it_and_replays_a_set_acceptance(capsys, llama_dir, tmp_path):
    out_file = tmp_path / "speculative.json"
    code, out, err = run_cli(
        capsys, "bench", str(llama_dir), "--batch", "1,2", "--input-len", "8", "--output-len", "13", "--repeats", "1",
        "--no-progress", "--set", "device=cpu", "--speculative-method", "replay", "--speculative-num-tokens", "4",
        "--set", "speculative.options.acceptance_length=3", "--set", "speculative.auto=false", "--out", str(out_file),
    )
    assert code == 0, err
    result = load_result(out_file)
    assert [run.id for run in result.runs] == [
        "synthetic/b1-in8-out13/autodeploy", "synthetic/b2-in8-out13/autodeploy",
        "synthetic/b1-in8-out13/no-speculation", "synthetic/b2-in8-out13/no-speculation",
    ]
    spec = result.runs[1].metrics["speculation"]
    # 13 tokens: 1 from the prompt's step, then rows of 3 (2 drafted right + the model's own) while 4 fit.
    assert spec["method"] == "replay" and spec["acceptance_length"] == 3.0 and spec["accepted_tokens"] == 2 * 2 * 4
    # Per judged token: each sequence's first three rows keep 2 and refuse the third; its last, a draft cut to the 2
    # tokens the output has left, keeps both: 16 accepted of 16 + 6 judged.
    assert spec["per_token_acceptance"] == pytest.approx(16 / 22) and spec["auto"] is None
    # Steps of decodes alone, by kind: the four drafting ones (the prompt's step is not one), none without a draft.
    assert {kind: counted["steps"] for kind, counted in spec["steps"].items()} == {"decoding": 0, "drafting": 4, "revisit": 0}
    assert spec["steps"]["drafting"]["mean_ms"] > 0 and "steps of decodes alone: 4 drafting (" in out
    assert result.runs[3].metrics.get("speculation") is None
    assert "output_tokens_per_s/no-speculation" in result.runs[0].ratios
    assert "replay, 4 tokens drafted a step; accepted 16 of" in out
    code, out, err = run_cli(capsys, "bench", str(llama_dir), "--batch", "1", "--speculative-method", "replay", *FAST)
    assert code == 1 and "acceptance_length" in err


def test_bench_with_auto_reports_the_acceptance_it_drafts_from_at_the_points_width(capsys, llama_dir, tmp_path):
    out_file = tmp_path / "auto.json"
    code, out, err = run_cli(
        capsys, "bench", str(llama_dir), "--batch", "2", "--input-len", "8", "--output-len", "9", "--repeats", "1",
        "--no-progress", "--set", "device=cpu", "--speculative-method", "replay", "--speculative-num-tokens", "4",
        "--set", "speculative.options.acceptance_length=3", "--out", str(out_file),
    )
    assert code == 0, err
    auto = load_result(out_file).runs[0].metrics["speculation"]["auto"]
    assert auto["batch"] == 2 and set(auto) == {"batch", "threshold_set_up", "threshold_as_run"}
    assert all(value is None or 0 < value <= 1 for value in (auto["threshold_set_up"], auto["threshold_as_run"]))
    assert "auto at 2: drafts from a per-token acceptance of" in out


def test_speculation_warms_up_on_each_workloads_own_first_requests_at_its_concurrency():
    from autodeploy.bench.benchmark import _speculation_warm_up
    from autodeploy.bench.workloads import BenchRequest, concurrency_workload

    requests = [BenchRequest([i, i + 1], 100 + i) for i in range(40)]
    warm = _speculation_warm_up(concurrency_workload(requests, 8, {"num_requests": 40}))
    assert warm.max_concurrency == 8 and [r.prompt_token_ids for r in warm.requests] == [[i, i + 1] for i in range(16)]
    assert {r.output_len for r in warm.requests} == {32} and all(r.arrival == 0 for r in warm.requests)
