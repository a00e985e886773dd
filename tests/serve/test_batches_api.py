"""The server's Files and Batch APIs (``serve --batch-dir``) through the official ``openai`` client, across a restart."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from autodeploy import SamplingParams
from autodeploy.serve import ServerOptions, build_app
from autodeploy.serve.server import serving_in_thread

MODEL = "tiny-llama"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def serving(llm, batch_dir):
    return serving_in_thread(build_app(llm, ServerOptions(served_model_name=MODEL, chat_template=CHAT_TEMPLATE,
                                                          batch_dir=str(batch_dir))))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def request_line(custom_id: str, prompt: str, max_tokens: int = 5, url: str = "/v1/completions") -> str:
    body = {"prompt": prompt} if url == "/v1/completions" else {"messages": [{"role": "user", "content": prompt}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {**body, "max_tokens": max_tokens, "temperature": 0}})


def wait_for(api: openai.OpenAI, batch_id: str, done, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = api.batches.retrieve(batch_id)
        if done(batch):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {batch.status} ({batch.request_counts}) after {timeout_s}s")


def batch_part_way(api: openai.OpenAI, count: int, max_tokens: int, completed: int):
    """A completions batch of ``count`` lines (far more than the 2 × max_batch_size in flight: it runs a while), once
    ``completed`` of them have results."""
    text = "\n".join(request_line(f"r{i}", f"# step {i}\ndef run():", max_tokens=max_tokens) for i in range(count))
    uploaded = api.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    batch = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    return wait_for(api, batch.id, lambda b: b.request_counts.completed >= completed)


def records(api: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(text) for text in api.files.content(file_id).text.splitlines()]


@pytest.mark.timeout(300)
def test_a_batch_through_the_openai_client_answers_each_line_once(llama_llm, tmp_path):
    prompts = ["def add(a, b):", "import os", "class Point:"]
    lines = [request_line(f"c{i}", prompt) for i, prompt in enumerate(prompts)]
    lines += ["{not json", request_line("chat", "hi", url="/v1/chat/completions"), request_line("c0", "again")]
    with serving(llama_llm, tmp_path) as url:
        api = client(url)
        uploaded = api.files.create(file=("requests.jsonl", "\n".join(lines).encode()), purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.bytes == len("\n".join(lines).encode())
        batch = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
                                   metadata={"job": "test"})
        assert batch.status == "validating" and batch.metadata == {"job": "test"}
        batch = wait_for(api, batch.id, lambda b: b.status == "completed")
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 3, 3)
        output, errors = records(api, batch.output_file_id), records(api, batch.error_file_id)
        expected = llama_llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0))
        texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in output}
        assert texts == {f"c{i}": o.outputs[0].text for i, o in enumerate(expected)}
        codes = sorted((r.get("line", 0), r["custom_id"], r["error"]["code"]) for r in errors)
        assert codes == [(0, "chat", "mismatched_url"), (4, None, "invalid_json"), (6, "c0", "duplicate_custom_id")]
        assert [b.id for b in api.batches.list()] == [batch.id]
        assert {f.purpose for f in api.files.list()} == {"batch", "batch_output"}
        assert api.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            api.files.retrieve(uploaded.id)


@pytest.mark.timeout(300)
def test_a_batch_running_when_the_server_stops_finishes_after_a_restart_with_each_line_once(llama_llm, tmp_path):
    count = 600
    with serving(llama_llm, tmp_path) as url:
        batch = batch_part_way(client(url), count, max_tokens=16, completed=3)
    stopped = json.loads((tmp_path / "batches" / f"{batch.id}.json").read_text())
    assert stopped["status"] == "in_progress"
    written = (tmp_path / "batches" / f"{batch.id}.output.jsonl").read_text().count("\n")
    assert 3 <= written < count
    with serving(llama_llm, tmp_path) as url:
        api = client(url)
        batch = wait_for(api, batch.id, lambda b: b.status == "completed")
        ids = [r["custom_id"] for r in records(api, batch.output_file_id)]
    assert sorted(ids) == sorted(f"r{i}" for i in range(count))  # each once
    assert batch.request_counts.completed == count and batch.error_file_id is None


@pytest.mark.timeout(300)
def test_cancel_stops_a_batch_and_keeps_what_finished(llama_llm, tmp_path):
    count = 600
    with serving(llama_llm, tmp_path) as url:
        api = client(url)
        batch = batch_part_way(api, count, max_tokens=24, completed=2)
        assert api.batches.cancel(batch.id).status == "cancelling"
        batch = wait_for(api, batch.id, lambda b: b.status == "cancelled")
        kept = records(api, batch.output_file_id)
        assert 2 <= len(kept) < count and all(r["response"]["body"]["choices"][0]["finish_reason"] != "abort" for r in kept)
        assert len({r["custom_id"] for r in kept}) == len(kept)


def test_bad_batch_requests_are_refused_with_the_field_named(llama_llm, tmp_path):
    with serving(llama_llm, tmp_path) as url:
        api = client(url)
        with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
            api.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune")
        uploaded = api.files.create(file=("in.jsonl", request_line("a", "x").encode()), purpose="batch")
        with pytest.raises(openai.BadRequestError, match=r"endpoint must be one of .*\(what this model serves\)"):
            api.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="completion_window must be '24h'"):
            api.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="1h")
        with pytest.raises(openai.NotFoundError, match="no file"):
            api.batches.create(input_file_id="file-" + "0" * 24, endpoint="/v1/completions", completion_window="24h")
        with pytest.raises(openai.NotFoundError, match="no batch"):
            api.batches.retrieve("batch-xyz")


def test_without_a_batch_dir_the_batch_routes_say_how_to_turn_them_on(llama_llm):
    with serving_in_thread(build_app(llama_llm, ServerOptions(served_model_name=MODEL))) as url:
        response = httpx.get(f"{url}/v1/batches")
        assert response.status_code == 404 and "--batch-dir" in response.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/files", files={"file": ("a", b"x")}, data={"purpose": "batch"}).status_code == 404


def test_results_of_a_batch_that_ended_just_before_a_stop_become_its_files_at_the_next_start(tmp_path):
    import asyncio

    from autodeploy.serve.batches_api import BatchStore

    store = BatchStore(tmp_path, MODEL, concurrency=2)
    batch = store.create_batch(store.add_file(request_line("a", "x").encode(), "in.jsonl", "batch")["id"],
                               "/v1/completions", "24h", None)
    results = tmp_path / "batches" / f"{batch['id']}.output.jsonl"
    results.write_text('{"custom_id": "a"}\n')
    batch.update(status="completed", output_file_id="file-" + "1" * 24)  # saved, then the server stopped
    (tmp_path / "batches" / f"{batch['id']}.json").write_text(json.dumps(batch))

    async def start_and_stop():
        store.start(app=None)
        await store.stop()

    asyncio.run(start_and_stop())
    assert store.file_content(batch["output_file_id"]).read_text() == '{"custom_id": "a"}\n' and not results.exists()


def test_the_batch_routes_need_the_api_key(llama_llm, tmp_path):
    options = ServerOptions(served_model_name=MODEL, api_key="sk-test", batch_dir=str(tmp_path))
    with serving_in_thread(build_app(llama_llm, options)) as url:
        assert httpx.get(f"{url}/v1/batches").status_code == 401
        assert httpx.post(f"{url}/v1/files", files={"file": ("a", b"x")}, data={"purpose": "batch"}).status_code == 401
        assert httpx.get(f"{url}/v1/batches", headers={"Authorization": "Bearer sk-test"}).json()["data"] == []


def test_a_batch_whose_input_has_no_request_fails_saying_so(llama_llm, tmp_path):
    with serving(llama_llm, tmp_path) as url:
        api = client(url)
        batch = api.batches.create(input_file_id=api.files.create(file=("in.jsonl", b"\n\n"), purpose="batch").id,
                                   endpoint="/v1/completions", completion_window="24h")
        batch = wait_for(api, batch.id, lambda b: b.status == "failed")
        assert batch.errors.data[0].code == "empty_file" and batch.failed_at is not None
