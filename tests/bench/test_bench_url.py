"""``autodeploy bench --url`` and ``--compare server``: the workloads over HTTP against a real server on loopback
over the tiny Llama (every request's length checked from the server's usage, metrics sane, the pool empty after),
failures counted and reported (a scripted fake server: errors, short answers, a hang), and bad input refused
before anything is measured."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

import autodeploy.bench.benchmark as benchmark
from autodeploy.bench.http_runner import ServerTarget, measure_over_http
from autodeploy.bench.metrics import headline_values, summarize
from autodeploy.bench.results import load_result
from autodeploy.bench.workloads import BenchRequest, concurrency_workload
from autodeploy.cli.main import main
from autodeploy.serve import ServerOptions, build_app
from autodeploy.serve.server import serving_in_thread
from tests.serve.test_openai_server import wait_idle

QUICK = ["--repeats", "1", "--no-progress", "--request-timeout", "30"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def url(llama_llm):
    with serving_in_thread(build_app(llama_llm, ServerOptions(served_model_name="tiny-llama", api_key="sk-bench"))) as base:
        yield base


def test_bench_url_runs_every_workload_over_http(capsys, llama_llm, llama_dir, url, tmp_path):
    out_file = tmp_path / "server.json"
    code, out, err = run_cli(
        capsys, "bench", str(llama_dir), "--url", url, "--api-key", "sk-bench", "--workload", "synthetic,poisson,concurrency",
        "--batch", "3", "--input-len", "8", "--output-len", "5", "--rate", "40", "--concurrency", "2", "--num-requests", "5",
        "--input-dist", "uniform:4:12", "--output-dist", "uniform:2:6", "--out", str(out_file), *QUICK,
    )
    assert code == 0, err
    result = load_result(out_file)
    assert result.model == "tiny-llama" and result.settings["max_model_len"] == llama_llm.engine.max_seq_len
    assert [run.id for run in result.runs] == [
        "synthetic/b3-in8-out5/server", "poisson/rate40-n5-inuniform:4:12-outuniform:2:6/server",
        "concurrency/c2-n5-inuniform:4:12-outuniform:2:6/server",
    ]
    requests = benchmark.realistic_requests(5, "uniform:4:12", "uniform:2:6", llama_llm.vocab_size, llama_llm.engine.max_seq_len)
    for run, (count, output_tokens) in zip(result.runs, [(3, 15), *[(5, sum(r.output_len for r in requests))] * 2]):
        m = run.metrics
        assert (m["num_requests"], m["output_tokens"], m["failed_requests"]) == (count, output_tokens, 0), run.id
        assert 0 < m["ttft_s"]["p50"] <= m["e2e_s"]["p50"] < 30 and m["output_tokens_per_s"] > 0
        # A loaded machine's server may send a request's tokens in one event: then it has no TPOT (never a TPOT of 0).
        assert m["tpot_s"] is None or m["tpot_s"]["p50"] > 0
        assert run.ratios == {}
    assert "synthetic/b3-in8-out5/server" in out and f"measured over HTTP: server at {url} (tiny-llama)" in out
    wait_idle(llama_llm)


def test_compare_server_measures_each_point_in_process_then_over_http(capsys, llama_dir, tmp_path):
    out_file = tmp_path / "compare.json"
    code, out, err = run_cli(
        capsys, "bench", str(llama_dir), "--workload", "concurrency", "--concurrency", "1,4", "--num-requests", "4",
        "--input-dist", "fixed:8", "--output-dist", "fixed:4", "--compare", "server", "--server-stream-interval", "2",
        "--set", "device=cpu", "--out", str(out_file), *QUICK,
    )
    assert code == 0, err
    result = load_result(out_file)
    assert result.settings["server_stream_interval"] == 2
    point = "concurrency/c4-n4-infixed:8-outfixed:4"
    first = "concurrency/c1-n4-infixed:8-outfixed:4"
    assert [run.id for run in result.runs] == [f"{first}/autodeploy", f"{point}/autodeploy", f"{first}/server", f"{point}/server"]
    served, in_process = result.run(f"{point}/server"), result.run(f"{point}/autodeploy")
    assert served.metrics["output_tokens"] == in_process.metrics["output_tokens"] == 16
    assert served.ratios["ttft_p50_s/autodeploy"] == pytest.approx(served.metrics["ttft_s"]["p50"] / in_process.metrics["ttft_s"]["p50"])
    assert set(served.ratios) >= {"output_tokens_per_s/autodeploy", "e2e_p50_s/autodeploy"}
    assert ("tpot_p50_s/autodeploy" in served.ratios) == (served.metrics["tpot_s"] is not None)  # none when every answer came in one event
    assert in_process.ratios == {} and in_process.metrics["prefix_cache_hit_rate"] == 0
    assert f"  {point}/server: output_tokens_per_s/autodeploy " in out and "over HTTP / in-process" in out


# ---- failures: a scripted server ------------------------------------------------------------------------------


def scripted_app() -> FastAPI:
    """Answers by max_tokens: 3 → all three tokens in one event, 5 → one token short, 6 → a 400, 7 → an error event
    mid-stream, 9 → never; else in full, a token an event."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "scripted", "object": "model", "max_model_len": 512}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        asked = (await request.json())["max_tokens"]
        if asked == 6:
            return JSONResponse({"error": {"message": "prompt too long", "type": "invalid_request_error"}}, status_code=400)

        async def events():
            if asked == 9:
                await asyncio.sleep(30)
            produced = asked - 1 if asked == 5 else asked
            if asked == 3:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'xxx', 'finish_reason': 'length'}]})}\n\n"
            for index in range(produced if asked != 3 else 0):
                if asked == 7 and index == 2:
                    yield f"data: {json.dumps({'error': {'message': 'engine step failed'}})}\n\n"
                    break
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x', 'finish_reason': None}]})}\n\n"
            usage = {"prompt_tokens": 1, "completion_tokens": produced, "total_tokens": produced + 1}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def scripted_url():
    with serving_in_thread(scripted_app()) as base:
        yield base


def test_every_failure_is_counted_with_its_reason_and_none_hangs(scripted_url):
    lengths = [4, 5, 6, 7, 9, 8]
    workload = concurrency_workload([BenchRequest([1, 2, 3], n) for n in lengths], 6, {"num_requests": 6, "input_len": 3, "output_len": "scripted"})
    # 5 s: far above a loaded machine's pauses between the answered requests' bytes, well below the hang's 30 s.
    measured = measure_over_http(ServerTarget(scripted_url, "scripted", timeout_s=5), workload, progress=False)
    assert sorted(t.output_len for t in measured.timings) == [4, 8]
    assert all(len(t.token_times) == t.output_len and t.ttft > 0 for t in measured.timings)
    assert sorted(measured.failures) == [
        "HTTP 400: prompt too long",
        "error in the stream: engine step failed",
        "no answer within --request-timeout 5s (ReadTimeout)",
        "produced 4 of the 5 tokens asked for (does the server honour ignore_eos?)",
    ]


def test_a_request_whose_tokens_arrive_in_one_event_has_no_tpot(scripted_url):
    # A server's loop that falls behind the engine (a loaded machine) merges a stream's tokens into one event: their
    # time is in TTFT and E2E, and no time between tokens was seen. A TPOT of 0 from such requests once made a run's
    # TPOT p50 0.
    workload = concurrency_workload([BenchRequest([1, 2, 3], 3)] * 2, 1, {"num_requests": 2, "input_len": 3, "output_len": 3})
    measured = measure_over_http(ServerTarget(scripted_url, "scripted", timeout_s=30), workload, progress=False)
    assert measured.failures == [] and [(t.output_len, len(t.token_times), t.tpot) for t in measured.timings] == [(3, 1, None)] * 2
    metrics = summarize(measured.timings)
    assert metrics["tpot_s"] is None and metrics["e2e_s"]["p50"] > 0 and metrics["output_tokens"] == 6
    assert "tpot_p50_s" not in headline_values(metrics)


def test_failures_appear_in_the_table_and_the_json(capsys, llama_dir, scripted_url, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt_token_ids": [1, 2, 3], "output_len": n}) + "\n" for n in (4, 6, 8, 6)))
    out_file = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "bench", str(llama_dir), "--url", scripted_url, "--workload", "concurrency", "--concurrency", "1",
                             "--num-requests", "4", "--dataset", str(dataset), "--out", str(out_file), *QUICK)
    assert code == 0, err
    (run,) = load_result(out_file).runs
    assert (run.metrics["num_requests"], run.metrics["failed_requests"], run.metrics["failures"]) == (2, 2, ["HTTP 400: prompt too long"])
    assert f"  {run.id}: 2 of 4, e.g. HTTP 400: prompt too long" in out


# ---- bad input ------------------------------------------------------------------------------------------------


def a_closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--url", "CLOSED"], "no server answers at http://127.0.0.1:"),
        (["--url", "localhost:8000"], "is not an http:// or https:// URL"),
        (["--url", "URL"], "refused the API key; pass its key with --api-key"),
        (["--url", "URL", "--api-key", "sk-bench", "--served-model-name", "gpt-4"], "does not serve 'gpt-4'; it serves ['tiny-llama']"),
        (["--url", "URL", "--compare", "hf-eager"], "--compare server,hf-eager"),
        (["--url", "URL", "--compare", "server"], "--url builds none"),
        (["--url", "URL", "--workload", "accuracy"], "a server does not return logits"),
        (["--url", "URL", "--request-timeout", "0"], "--request-timeout must be > 0"),
        (["--compare", "triton"], "choose from hf-eager, hf-compile, server"),
        (["--server-stream-interval", "4"], "add --compare server"),
        (["--compare", "server", "--server-stream-interval", "0"], "stream_interval must be a positive integer"),
        # The demo model's 8192-token vocabulary against the tiny Llama's 512: the warm-up is refused.
        (["--url", "URL", "--api-key", "sk-bench", "--model-is-demo"], "the warm-up: 2 of 2 requests to the server at"),
    ],
)
def test_bad_input_fails_before_anything_is_measured(capsys, monkeypatch, llama_dir, url, arguments, message):
    def measured(*args, **kwargs):
        raise AssertionError("a measurement started before the input was checked")

    monkeypatch.setattr(benchmark, "run_workload", measured)
    model = [] if "--model-is-demo" in arguments else [str(llama_dir)]
    arguments = [{"CLOSED": a_closed_port(), "URL": url}.get(a, a) for a in arguments if a != "--model-is-demo"]
    code, _, err = run_cli(capsys, "bench", *model, "--workload", "synthetic", "--batch", "2", "--input-len", "4",
                           "--output-len", "2", *QUICK, *arguments)
    assert code == 1 and err.startswith("error: ") and message in err, err
