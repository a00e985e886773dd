"""``autodeploy batch``: OpenAI Batch API files through the server's routes in process, resumable after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autodeploy import SamplingParams
from autodeploy.errors import ConfigError
from autodeploy.serve.batch_file import finished_keys, parse_batch_lines, table_lines
from autodeploy.serve.batch_job import run_batch_file

MODEL = "tiny-llama"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def line(custom_id: str, prompt: str, max_tokens: int = 6, url: str = "/v1/completions", **body) -> str:
    payload = {"prompt": prompt} if url == "/v1/completions" else {"messages": [{"role": "user", "content": prompt}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {**payload, "max_tokens": max_tokens, "temperature": 0, **body}})


def results(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def run(llm, source: Path, output: Path, **options):
    return run_batch_file(llm, source, output, served_model_name=MODEL, progress=False,
                          server_options={"chat_template": CHAT_TEMPLATE}, **options)


def test_a_line_that_is_not_a_request_becomes_an_error_record_naming_it():
    parsed = parse_batch_lines([
        "not json",
        "[1, 2]",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
        line("a", "x"),
        line("a", "y"),
        json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}),
        json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/images", "body": {}}),
        json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": "text"}),
        line("e", "x", stream=True),
        "   ",
    ])
    codes = [(p.number, p.key, p.error and p.error[0]) for p in parsed]
    assert codes == [(1, "#1", "invalid_json"), (2, "#2", "invalid_request"), (3, "#3", "missing_custom_id"), (4, "a", None),
                     (5, "#5", "duplicate_custom_id"), (6, "b", "invalid_method"), (7, "c", "invalid_url"),
                     (8, "d", "invalid_body"), (9, "e", "invalid_body")]
    assert "line 5" in parsed[4].error[1] and "'a'" in parsed[4].error[1]


def test_finished_keys_cuts_a_partial_last_line_and_refuses_a_file_it_did_not_write(tmp_path):
    output = tmp_path / "out.jsonl"
    output.write_text('{"custom_id": "a", "response": null, "error": null}\n{"custom_id": null, "line": 3}\n{"custom_id": "b", "resp')
    assert finished_keys(output) == {"a", "#3"}
    assert output.read_text().endswith('"line": 3}\n')  # the cut-short write is gone: b runs again
    (tmp_path / "other.jsonl").write_text("hello\n")
    with pytest.raises(ConfigError, match="not a result this command wrote"):
        finished_keys(tmp_path / "other.jsonl")


def test_every_line_gets_one_result_with_the_routes_answer(llama_llm, tmp_path):
    prompts = ["def add(a, b):", "def add(a, b):\n    return", "import os", "class Point:"]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([
        *(line(f"c{i}", prompt) for i, prompt in enumerate(prompts)),
        line("chat", "hello", url="/v1/chat/completions"),
        line("too-many", "x", max_tokens=-1),
        "{broken",
        line("c0", "again"),
        json.dumps({"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
    ]) + "\n")
    output = tmp_path / "out.jsonl"
    summary = run(llama_llm, source, output, concurrency=3)
    records = results(output)
    assert sorted(r.get("custom_id") or f"#{r['line']}" for r in records) == sorted(
        ["c0", "c1", "c2", "c3", "chat", "too-many", "#7", "c0", "emb"])
    assert (summary.succeeded, summary.failed, summary.already_done) == (5, 4, 0)
    by_id = {r["custom_id"]: r for r in records if "line" not in r}
    expected = llama_llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    for i, output_of_prompt in enumerate(expected):  # greedy: the engine's own text for the prompt
        response = by_id[f"c{i}"]["response"]
        assert response["status_code"] == 200 and by_id[f"c{i}"]["error"] is None
        assert response["body"]["object"] == "text_completion" and response["body"]["model"] == MODEL
        assert response["body"]["choices"][0]["text"] == output_of_prompt.outputs[0].text
    assert by_id["chat"]["response"]["body"]["object"] == "chat.completion"
    refused = by_id["too-many"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"
    assert by_id["emb"]["error"]["code"] == "unsupported_url" and by_id["emb"]["response"] is None
    duplicate = next(r for r in records if r.get("line") == 8)
    assert duplicate["error"]["code"] == "duplicate_custom_id"


def test_a_job_stopped_part_way_finishes_on_the_next_run_with_each_line_once(llama_llm, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(line(f"r{i}", f"def f{i}(x):") for i in range(12)) + "\n")
    output = tmp_path / "out.jsonl"

    class Stop(Exception):
        pass

    seen = []

    def stop_after_five(record):
        seen.append(record["custom_id"])
        if len(seen) == 5:
            raise Stop

    with pytest.raises(Stop):
        run(llama_llm, source, output, concurrency=2, on_result=stop_after_five)
    # The other worker's request may have finished before the stop reached it: a real result, written too.
    written = [record["custom_id"] for record in results(output)]
    assert 5 <= len(written) <= 6 and all(record["response"]["status_code"] == 200 for record in results(output))
    unfinished = sorted({f"r{i}" for i in range(12)} - set(written))
    with output.open("a") as handle:  # and a write the stop cut short
        handle.write(f'{{"id": "batch_req_x", "custom_id": "{unfinished[0]}", "resp')
    again = []
    summary = run(llama_llm, source, output, on_result=lambda record: again.append(record["custom_id"]))
    assert summary.already_done == len(written) and summary.succeeded == 12 - len(written)
    assert sorted(again) == unfinished
    assert sorted(r["custom_id"] for r in results(output)) == sorted(f"r{i}" for i in range(12))


def test_an_input_saved_with_a_byte_order_mark_and_crlf_line_ends_reads_as_any_other(llama_llm, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(("\ufeff" + line("a", "x") + "\r\n" + line("b", "y") + "\r\n").encode())
    summary = run(llama_llm, source, tmp_path / "out.jsonl")
    assert (summary.succeeded, summary.failed) == (2, 0)


def test_the_same_input_and_output_file_is_refused(llama_llm, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(line("a", "x") + "\n")
    with pytest.raises(ConfigError, match="same file"):
        run(llama_llm, source, source)


@pytest.mark.timeout(600)
def test_the_command_killed_mid_job_and_run_again_loses_and_repeats_nothing(tmp_path):
    source = tmp_path / "in.jsonl"
    count = 40
    source.write_text("\n".join(line(f"k{i}", f"# task {i}\ndef solve():", max_tokens=24) for i in range(count)) + "\n")
    output = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "autodeploy", "batch", "--input", str(source), "--output", str(output), "--no-progress",
               "--concurrency", "2", "--set", "device=cpu", "--set", "dtype=float32"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and job.poll() is None:
            if output.exists() and output.read_text().count("\n") >= 3:
                break
            time.sleep(0.05)
        assert job.poll() is None, f"the job ended before it could be killed: {job.stdout.read().decode()[-2000:]}"
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    done_before = len(results_whole(output))
    assert 3 <= done_before < count
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert f"{count} lines: {done_before} already done, {count - done_before} succeeded, 0 failed" in finished.stdout
    ids = [r["custom_id"] for r in results(output)]
    assert sorted(ids) == sorted(f"k{i}" for i in range(count))  # each once


def results_whole(path: Path) -> list[dict]:
    """The whole lines of a file a kill may have cut short."""
    text = path.read_text()
    return [json.loads(part) for part in text[: text.rfind("\n") + 1].splitlines()]


def test_a_parquet_table_runs_a_request_a_row_with_the_shared_parameters(llama_llm, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = ["def add(a, b):", "import os", None]
    pq.write_table(pa.table({"id": ["x", "y", "z"], "text": prompts}), tmp_path / "rows.parquet")
    output = tmp_path / "out.jsonl"
    summary = run(llama_llm, tmp_path / "rows.parquet", output, columns={"prompt": "text", "custom_id": "id"},
                  body={"max_tokens": 5, "temperature": 0})
    by_id = {r["custom_id"]: r for r in results(output)}
    expected = llama_llm.generate(prompts[:2], SamplingParams(max_tokens=5, temperature=0))
    assert [by_id[k]["response"]["body"]["choices"][0]["text"] for k in "xy"] == [o.outputs[0].text for o in expected]
    assert by_id["z"]["response"]["status_code"] == 400  # a null prompt: the route's refusal, as a result
    assert (summary.succeeded, summary.failed) == (2, 1)


def test_a_datasets_folder_of_arrow_streams_runs_as_chat_with_row_ids(llama_llm, tmp_path):
    import pyarrow as pa

    folder = tmp_path / "saved"
    folder.mkdir()
    messages = [[{"role": "user", "content": f"hello {i}"}] for i in range(3)]
    for shard, rows in enumerate((messages[:2], messages[2:])):  # what datasets' save_to_disk writes: IPC streams
        table = pa.table({"conversation": rows, "n": list(range(len(rows)))})
        with pa.OSFile(str(folder / f"data-0000{shard}-of-00002.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (folder / "dataset_info.json").write_text("{}")
    lines = table_lines(folder, {"messages": "conversation"}, body={"max_tokens": 3})
    assert [json.loads(text)["custom_id"] for text in lines] == ["row-0", "row-1", "row-2"]
    assert json.loads(lines[2])["url"] == "/v1/chat/completions"
    output = tmp_path / "out.jsonl"
    summary = run(llama_llm, folder, output, columns={"messages": "conversation"}, body={"max_tokens": 3})
    assert summary.succeeded == 3
    assert {r["response"]["body"]["object"] for r in results(output)} == {"chat.completion"}


def test_a_table_input_names_a_missing_column_and_a_bad_mapping(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "rows.parquet")
    with pytest.raises(ConfigError, match="no column 'prompt'; its columns: text"):
        table_lines(tmp_path / "rows.parquet", {"prompt": "prompt"})
    with pytest.raises(ConfigError, match="prompt=COLUMN"):
        table_lines(tmp_path / "rows.parquet", {"prompt": "text", "messages": "text"})
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match="cannot read"):
        table_lines(tmp_path / "bad.parquet", {"prompt": "text"})


def test_table_options_on_a_jsonl_input_are_refused(llama_llm, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(line("a", "x") + "\n")
    with pytest.raises(ConfigError, match="apply to a Parquet"):
        run(llama_llm, source, tmp_path / "out.jsonl", columns={"prompt": "text"})


def test_the_command_refuses_bad_files_before_it_builds_the_model(tmp_path, forbid_building, capsys):
    from autodeploy.cli.main import main

    forbid_building()
    source, foreign = tmp_path / "in.jsonl", tmp_path / "notes.txt"
    source.write_text(line("a", "x") + "\n")
    foreign.write_text("my notes\n")
    assert main(["batch", "--input", str(source), "--output", str(foreign)]) == 1
    assert "line 1 is not a result this command wrote" in capsys.readouterr().err
    assert main(["batch", "--input", str(source), "--output", str(tmp_path / "o.jsonl"), "--columns", "prompt=text"]) == 1
    assert "apply to a Parquet" in capsys.readouterr().err


def test_a_full_queue_is_waited_out_and_an_engine_stopping_writes_nothing():
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from autodeploy.serve.batch_file import EngineStopped, send_lines

    answers = {"/v1/completions": [(503, "queue_full"), (200, None)], "/v1/chat/completions": [(503, "aborted")]}
    app = FastAPI()

    @app.post("/v1/{route:path}")
    async def route(route: str):
        status, code = answers[f"/v1/{route}"].pop(0)
        body = {"error": {"message": "m", "code": code}} if code else {"ok": True}
        return JSONResponse(body, status_code=status, headers={"Retry-After": "0"})

    finished = []
    (waits,) = parse_batch_lines([line("a", "x")])
    asyncio.run(send_lines(app, [waits], MODEL, 2, lambda line, status, body: finished.append((line.custom_id, status, body))))
    assert finished == [("a", 200, {"ok": True})]
    (stops,) = parse_batch_lines([line("b", "y", url="/v1/chat/completions")])
    with pytest.raises(EngineStopped, match="run the job again"):
        asyncio.run(send_lines(app, [stops], MODEL, 2, lambda *args: finished.append(args)))
    assert len(finished) == 1
