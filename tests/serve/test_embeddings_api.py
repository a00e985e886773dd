"""The embedding routes (``/v1/embeddings``, rerank, score) and the ``AsyncEmbedder`` that merges their requests, over a
fake embedding LLM: deterministic vectors from each input's token ids, scores from the words a document shares with
the query, and a gate that holds a call so that requests can pile up behind it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
import zlib
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from omegaconf import OmegaConf

from autodeploy.errors import InvalidRequestError, UnsupportedModelError
from autodeploy.frontend.async_embed import AsyncEmbedder, EmbedderShutDown
from autodeploy.frontend.llm import Embeddings, Scores
from autodeploy.serve import ServerOptions, build_app
from autodeploy.serve.batch_job import run_batch_file
from autodeploy.serve.server import serving_in_thread

MODEL = "tiny-embedder"
API_KEY = "sk-test"
VOCAB = 1000
CLS, SEP = 1, 2
WAIT_S = 20  # every wait here ends in this at most: a hang fails the test instead of stalling the suite


class WordTokenizer:
    """A word a token: [CLS] words [SEP]."""

    def __call__(self, text: str, add_special_tokens: bool = True):
        ids = [3 + zlib.crc32(word.encode()) % (VOCAB - 3) for word in text.split()]
        return SimpleNamespace(input_ids=[CLS, *ids, SEP] if add_special_tokens else ids)


class FakeEmbeddingLLM:
    """``LLM``'s embed/score interface. ``gate`` cleared holds every call (``entered`` says one is waiting there);
    ``calls`` records (kind, number of inputs) of each call."""

    def __init__(self, tasks=("embed",), dim: int = 8, max_seq_len: int = 16, max_num_tokens: int = 2048):
        self.tasks = frozenset(tasks)
        self.dim = dim
        self.max_seq_len = max_seq_len
        self.tokenizer = WordTokenizer()
        self.settings = OmegaConf.create({"max_batch_size": 4, "scheduler": {"max_num_tokens": max_num_tokens}})
        self.calls: list[tuple[str, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def token_ids(self, item) -> list[int]:
        return self.tokenizer(item).input_ids if isinstance(item, str) else list(item)

    def vector(self, item, dimensions: int | None = None, normalize: bool = True) -> torch.Tensor:
        """The model's vector for one input, as ``embed`` computes it."""
        ids = self.token_ids(item)
        generator = torch.Generator().manual_seed(zlib.crc32(json.dumps(ids).encode()))
        vector = torch.randn(self.dim, generator=generator)[:dimensions]
        return torch.nn.functional.normalize(vector, dim=0) if normalize else vector

    def relevance(self, query: str, document: str) -> float:
        words = set(query.split())
        return float(torch.sigmoid(torch.tensor(4.0 * len(words & set(document.split())) / len(words) - 2.0)))

    def _hold(self, kind: str, count: int) -> None:
        self.entered.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        self.entered.clear()
        self.calls.append((kind, count))

    def embed(self, inputs, *, pooling=None, normalize=None, dimensions=None) -> Embeddings:
        if "embed" not in self.tasks:
            raise UnsupportedModelError("this model does not embed")
        self._hold("embed", len(inputs))
        if not inputs:
            raise InvalidRequestError("no input")
        texts = [self.token_ids(item) for item in inputs]
        for index, ids in enumerate(texts):
            if inputs[index] == "":
                raise InvalidRequestError(f"input {index} is an empty string: there is nothing to embed")
            if len(ids) > self.max_seq_len:
                raise InvalidRequestError(f"input {index} is {len(ids)} tokens; this model reads at most {self.max_seq_len}")
            if any(not 0 <= t < VOCAB for t in ids):
                raise InvalidRequestError(f"input {index} has token ids outside the vocabulary [0, {VOCAB})")
        if dimensions is not None and not 1 <= dimensions <= self.dim:
            raise InvalidRequestError(f"dimensions must be between 1 and the model's {self.dim}; got {dimensions}")
        vectors = torch.stack([self.vector(item, dimensions, normalize is not False) for item in inputs])
        return Embeddings(vectors, [len(ids) for ids in texts])

    def score(self, query: str, documents) -> Scores:
        if "score" not in self.tasks:
            raise UnsupportedModelError("this model does not score")
        self._hold("score", len(documents))
        pairs = [len(self.token_ids(query)) + len(self.token_ids(d)) - 1 for d in documents]
        for index, tokens in enumerate(pairs):
            if tokens > self.max_seq_len:
                raise InvalidRequestError(f"pair {index} is {tokens} tokens; this model reads at most {self.max_seq_len}")
        return Scores([self.relevance(query, d) for d in documents], pairs)


@contextlib.contextmanager
def serving(llm, **options):
    with serving_in_thread(build_app(llm, ServerOptions(served_model_name=MODEL, **options))) as base:
        yield base


def client_of(base: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=WAIT_S)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, WAIT_S))


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.005)


def while_held(llm, queue, first=lambda embedder: embedder.embed(["first"]), before_release=None, exceptions=False) -> list:
    """The worker held in a first call (``first``), ``queue(embedder)``'s requests queued meanwhile (and
    ``before_release(futures)`` run), then released: the answers, the first call's first."""

    async def main():
        embedder = AsyncEmbedder(llm)
        llm.gate.clear()
        held = asyncio.ensure_future(first(embedder))
        await until(llm.entered.is_set)
        futures = [asyncio.ensure_future(coroutine) for coroutine in queue(embedder)]
        await asyncio.sleep(0.05)
        if before_release is not None:
            await before_release(futures)
        llm.gate.set()
        waited = [f for f in futures if not f.cancelled()]
        answers = await asyncio.gather(held, *waited, return_exceptions=exceptions)
        embedder.shutdown()
        return answers

    return run(main())


@pytest.fixture(scope="module")
def embedder_url():
    with serving(FakeEmbeddingLLM(tasks=("embed",))) as base:
        yield base


@pytest.fixture(scope="module")
def reranker_url():
    with serving(FakeEmbeddingLLM(tasks=("score",), max_seq_len=32)) as base:
        yield base


# ---- /v1/embeddings through the official client ---------------------------------------------------------------


def test_the_openai_client_gets_the_models_vectors_as_base64_and_as_floats(embedder_url):
    llm = FakeEmbeddingLLM()
    client = client_of(embedder_url)
    texts = ["what is paged attention", "a KV cache in blocks", "hello"]
    for encoding in ({}, {"encoding_format": "float"}):  # untold, the client asks for base64 and decodes it
        response = client.embeddings.create(model=MODEL, input=texts, **encoding)
        assert [d.index for d in response.data] == [0, 1, 2] and response.model == MODEL
        for item, text in zip(response.data, texts):
            assert torch.allclose(torch.tensor(item.embedding), llm.vector(text), atol=1e-6)
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(t.split()) + 2 for t in texts)
    raw = httpx.post(f"{embedder_url}/v1/embeddings", json={"model": MODEL, "input": "hello", "encoding_format": "base64",
                                                            "user": "someone"}).json()
    decoded = torch.frombuffer(bytearray(base64.b64decode(raw["data"][0]["embedding"])), dtype=torch.float32)
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"
    assert torch.equal(decoded, llm.vector("hello"))


def test_token_ids_a_single_string_and_dimensions(embedder_url):
    llm = FakeEmbeddingLLM()
    client = client_of(embedder_url)
    by_ids = client.embeddings.create(model=MODEL, input=[[5, 6, 7], [8]])
    assert torch.allclose(torch.tensor(by_ids.data[1].embedding), llm.vector([8]), atol=1e-6)
    one = client.embeddings.create(model=MODEL, input=[5, 6, 7])
    assert len(one.data) == 1 and torch.allclose(torch.tensor(one.data[0].embedding), llm.vector([5, 6, 7]), atol=1e-6)
    short = client.embeddings.create(model=MODEL, input="matryoshka doll", dimensions=3)
    vector = torch.tensor(short.data[0].embedding)
    assert vector.shape == (3,) and torch.allclose(vector, llm.vector("matryoshka doll", dimensions=3), atol=1e-6)
    assert abs(vector.norm().item() - 1) < 1e-5  # the first three components, normalized again


@pytest.mark.parametrize("body, param, says", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": ["ok", ""]}, "input", "input 1 is empty"),
    ({"input": [[1, 2], []]}, "input", "input 1 is empty"),
    ({"input": " ".join(["word"] * 20)}, "input", "at most 16"),
    ({"input": [[1, 2, 5000]]}, "input", "outside the vocabulary"),
    ({"input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "x", "dimensions": 9}, "dimensions", "between 1 and the model's 8"),
    ({"input": "x", "encoding_format": "fp16"}, "encoding_format", "float"),
    ({"input": "x", "truncate": True}, "truncate", "not a field"),
    ({"input": "x", "model": "other"}, "model", "not served here"),
])
def test_a_bad_request_is_a_400_naming_its_field(embedder_url, body, param, says):
    response = httpx.post(f"{embedder_url}/v1/embeddings", json={"model": MODEL, **body})
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and says in error["message"], error


def test_the_api_key_guards_the_embedding_routes():
    with serving(FakeEmbeddingLLM(tasks=("embed", "score")), api_key=API_KEY) as base:
        with pytest.raises(openai.AuthenticationError):
            client_of(base).embeddings.create(model=MODEL, input="x")
        refused = httpx.post(f"{base}/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert len(client_of(base, API_KEY).embeddings.create(model=MODEL, input="x").data) == 1
        assert httpx.get(f"{base}/health").status_code == 200


# ---- rerank and score --------------------------------------------------------------------------------------------


def test_rerank_orders_the_documents_by_relevance_cut_to_top_n(reranker_url):
    llm = FakeEmbeddingLLM(tasks=("score",))
    query = "paged attention kv cache"
    documents = ["a recipe for bread", "the kv cache in pages", "paged attention keeps the kv cache in blocks", "attention"]
    expected = sorted(range(4), key=lambda i: llm.relevance(query, documents[i]), reverse=True)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        answer = httpx.post(f"{reranker_url}{path}", json={"model": MODEL, "query": query, "documents": documents}).json()
        assert [r["index"] for r in answer["results"]] == expected
        assert [r["document"]["text"] for r in answer["results"]] == [documents[i] for i in expected]
        assert answer["results"][0]["relevance_score"] == pytest.approx(llm.relevance(query, documents[expected[0]]))
        assert answer["model"] == MODEL and answer["id"].startswith("rerank-")
        assert answer["usage"]["total_tokens"] == sum(len(query.split()) + len(d.split()) + 3 for d in documents)
    as_objects = httpx.post(f"{reranker_url}/v1/rerank", json={"query": query, "documents": [{"text": d} for d in documents],
                                                                "top_n": 2, "return_documents": False}).json()
    assert [r["index"] for r in as_objects["results"]] == expected[:2]
    assert all("document" not in r for r in as_objects["results"])


def test_score_pairs_one_with_one_one_with_many_and_item_by_item(reranker_url):
    llm = FakeEmbeddingLLM(tasks=("score",))

    def scores(text_1, text_2) -> list[float]:
        answer = httpx.post(f"{reranker_url}/v1/score", json={"model": MODEL, "text_1": text_1, "text_2": text_2}).json()
        assert answer["object"] == "list" and answer["id"].startswith("score-") and answer["model"] == MODEL
        assert [d["index"] for d in answer["data"]] == list(range(len(answer["data"])))
        assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
        return [d["score"] for d in answer["data"]]

    assert scores("red apple", "a red apple") == pytest.approx([llm.relevance("red apple", "a red apple")])
    documents = ["a red apple", "a green pear", "red"]
    one_to_many = [llm.relevance("red apple", d) for d in documents]
    assert scores("red apple", documents) == pytest.approx(one_to_many)
    assert scores(["red apple"], documents) == pytest.approx(one_to_many)
    queries = ["red apple", "green pear", "red apple"]
    assert scores(queries, documents) == pytest.approx([llm.relevance(q, d) for q, d in zip(queries, documents)])
    assert httpx.post(f"{reranker_url}/score", json={"text_1": "a", "text_2": "a"}).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": "a"}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": " ".join(["long"] * 40)}, "text_2"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": [{"title": "t"}]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "model": "other"}, "model"),
])
def test_bad_rerank_and_score_shapes_are_400s(reranker_url, path, body, param):
    response = httpx.post(f"{reranker_url}{path}", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.json()


# ---- which routes a deployment answers ---------------------------------------------------------------------------


def test_a_route_of_a_task_the_model_lacks_says_what_it_serves(embedder_url, reranker_url):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        refused = httpx.post(f"{embedder_url}{path}", json={"model": MODEL, "messages": [], "prompt": "x"})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["code"] == "unsupported_task"
        assert error["message"] == "this model serves embeddings (/v1/embeddings); it does not generate text"
    rerank = httpx.post(f"{embedder_url}/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert rerank.status_code == 400 and "it does not score (rerank)" in rerank.json()["error"]["message"]
    embeddings = httpx.post(f"{reranker_url}/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert embeddings.status_code == 400 and embeddings.json()["error"]["message"] == (
        "this model serves relevance scores (/v1/rerank, /v1/score); it does not embed text")


def test_a_generating_model_answers_embeddings_with_the_400(llama_llm):
    with serving(llama_llm) as base:
        refused = httpx.post(f"{base}/v1/embeddings", json={"model": MODEL, "input": "x"})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"].startswith("this model serves text generation (/v1/completions")
        assert "it does not embed text" in refused.json()["error"]["message"]
        assert httpx.post(f"{base}/v1/score", json={"text_1": "a", "text_2": "b"}).status_code == 400


def test_the_embedding_app_describes_its_model_and_tokenizes(embedder_url):
    client = client_of(embedder_url)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    tokens = httpx.post(f"{embedder_url}/tokenize", json={"prompt": "two words"}).json()
    assert tokens == {"count": 4, "max_model_len": 16, "tokens": WordTokenizer()("two words").input_ids}
    assert httpx.get(f"{embedder_url}/v1/batches").status_code == 404  # without --batch-dir


def test_a_full_queue_answers_503_with_retry_after():
    llm = FakeEmbeddingLLM()
    llm.gate.clear()
    with serving(llm, max_queued_requests=1, queue_timeout_s=0, retry_after_s=3) as base:
        first = threading.Thread(target=httpx.post, args=(f"{base}/v1/embeddings",),
                                 kwargs={"json": {"model": MODEL, "input": "x"}, "timeout": WAIT_S})
        first.start()
        assert llm.entered.wait(WAIT_S)
        refused = httpx.post(f"{base}/v1/embeddings", json={"model": MODEL, "input": "y"})
        llm.gate.set()
        first.join(WAIT_S)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "3"
        assert refused.json()["error"]["code"] == "queue_full"


# ---- coalescing ----------------------------------------------------------------------------------------------------


def test_concurrent_http_requests_share_forwards():
    llm = FakeEmbeddingLLM()
    llm.gate.clear()
    texts = [f"text number {i}" for i in range(8)]
    answers: dict[int, list[float]] = {}
    with serving(llm) as base:
        client = client_of(base)

        def send(index: int) -> None:
            answers[index] = client.embeddings.create(model=MODEL, input=texts[index]).data[0].embedding

        threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        assert llm.entered.wait(WAIT_S)
        time.sleep(1.0)  # the other requests reach the queue behind the held call
        llm.gate.set()
        for thread in threads:
            thread.join(WAIT_S)
    assert sorted(answers) == list(range(8))
    for index, vector in answers.items():
        assert torch.allclose(torch.tensor(vector), llm.vector(texts[index]), atol=1e-6)
    assert sum(count for _, count in llm.calls) == 8 and len(llm.calls) < 8, llm.calls


def test_requests_queued_together_run_as_one_call():
    llm = FakeEmbeddingLLM()
    held, *queued, other = while_held(llm, lambda embedder: [
        *(embedder.embed([f"w{i}", f"v{i}"], dimensions=4) for i in range(5)),
        embedder.embed("mean", pooling="mean")])  # one text: one input
    assert llm.calls == [("embed", 1), ("embed", 10), ("embed", 1)]  # the five requests in one forward
    for i, answer in enumerate(queued):
        assert torch.allclose(answer.vectors, torch.stack([llm.vector(f"w{i}", 4), llm.vector(f"v{i}", 4)]))
        assert answer.num_tokens == [3, 3]
    assert held.vectors.shape == (1, 8) and other.vectors.shape == (1, 8)


def test_a_cancelled_request_leaves_the_queue():
    llm = FakeEmbeddingLLM()

    async def leave(futures):
        futures[0].cancel()
        await asyncio.sleep(0.01)  # the cancellation reaches the coroutine

    _, stays = while_held(llm, lambda embedder: [embedder.embed(["the client left"]), embedder.embed(["stays", "too"])],
                          before_release=leave)
    assert llm.calls == [("embed", 1), ("embed", 2)] and stays.vectors.shape == (2, 8)


def test_a_bad_request_in_a_merged_call_fails_alone():
    llm = FakeEmbeddingLLM()
    _, good, bad, later = while_held(llm, lambda embedder: [
        embedder.embed(["fine", "also fine"]), embedder.embed(["ok", " ".join(["far"] * 30)]), embedder.embed(["fine too"])],
        exceptions=True)
    assert isinstance(bad, InvalidRequestError) and bad.param == "input" and "input 1 is 32 tokens" in str(bad)
    assert torch.allclose(good.vectors[1], llm.vector("also fine")) and torch.allclose(later.vectors[0], llm.vector("fine too"))
    assert llm.calls == [("embed", 1), ("embed", 5), ("embed", 2), ("embed", 2), ("embed", 1)]  # refused merged: one by one


def test_a_large_request_runs_a_budget_at_a_time_and_lets_later_ones_in():
    llm = FakeEmbeddingLLM(max_num_tokens=8)  # "wN" is estimated 2 tokens: four inputs a call
    finished: list[str] = []

    async def main():
        embedder = AsyncEmbedder(llm)
        llm.gate.clear()
        held = asyncio.ensure_future(embedder.embed(["first"]))
        await until(llm.entered.is_set)

        async def named(name, coroutine):
            answer = await coroutine
            finished.append(name)
            return answer

        large = asyncio.ensure_future(named("large", embedder.embed([f"w{i}" for i in range(10)])))
        small = asyncio.ensure_future(named("small", embedder.embed(["s"])))
        await asyncio.sleep(0.05)
        llm.gate.set()
        answers = await asyncio.gather(held, large, small)
        embedder.shutdown()
        return answers

    _, large, small = run(main())
    assert llm.calls == [("embed", 1), ("embed", 4), ("embed", 4), ("embed", 3)]
    assert finished == ["small", "large"]  # in the second call, beside the large request's next four
    assert torch.allclose(large.vectors, torch.stack([llm.vector(f"w{i}") for i in range(10)]))
    assert large.num_tokens == [3] * 10 and torch.allclose(small.vectors[0], llm.vector("s"))


def test_score_requests_for_the_same_query_share_a_call():
    llm = FakeEmbeddingLLM(tasks=("score",))
    _, *same, other = while_held(llm, lambda embedder: [
        *(embedder.score("red apple", [f"red {i}", "pear"]) for i in range(3)), embedder.score("pear", ["pear"])],
        first=lambda embedder: embedder.score("q", ["first"]))
    assert llm.calls == [("score", 1), ("score", 6), ("score", 1)]
    for i, answer in enumerate(same):
        assert answer.scores == pytest.approx([llm.relevance("red apple", f"red {i}"), llm.relevance("red apple", "pear")])
    assert other.scores == pytest.approx([llm.relevance("pear", "pear")])


# ---- shutdown ---------------------------------------------------------------------------------------------------


def test_shutdown_fails_the_queued_requests_at_once_and_finishes_the_running_call():
    llm = FakeEmbeddingLLM()

    async def main():
        embedder = AsyncEmbedder(llm)
        llm.gate.clear()
        running = asyncio.ensure_future(embedder.embed(["running"]))
        await until(llm.entered.is_set)
        queued = [asyncio.ensure_future(embedder.embed([f"queued {i}"])) for i in range(3)]
        await asyncio.sleep(0.05)
        stopping = threading.Thread(target=embedder.shutdown)  # it waits for the running call
        stopping.start()
        failed = await asyncio.gather(*queued, return_exceptions=True)  # before the gate opens
        llm.gate.set()
        answer = await running
        stopping.join(WAIT_S)
        assert not stopping.is_alive()
        with pytest.raises(EmbedderShutDown, match="shut down"):
            await embedder.embed(["after"])
        return failed, answer

    failed, answer = run(main())
    assert all(isinstance(error, EmbedderShutDown) and "send it again" in str(error) for error in failed)
    assert torch.allclose(answer.vectors[0], llm.vector("running"))


def test_requests_queued_when_the_server_stops_answer_503_aborted():
    llm = FakeEmbeddingLLM()
    app = build_app(llm, ServerOptions(served_model_name=MODEL))

    async def main():
        llm.gate.clear()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            async with app.router.lifespan_context(app):
                running = asyncio.ensure_future(client.post("/v1/embeddings", json={"model": MODEL, "input": "a"}))
                await until(llm.entered.is_set)
                queued = asyncio.ensure_future(client.post("/v1/embeddings", json={"model": MODEL, "input": "b"}))
                await asyncio.sleep(0.3)
                threading.Timer(0.3, llm.gate.set).start()  # the shutdown waits for the running call
            return await running, await queued

    running, queued = run(main())
    assert running.status_code == 200
    assert queued.status_code == 503 and queued.json()["error"]["code"] == "aborted"


# ---- autodeploy batch ---------------------------------------------------------------------------------------------


def test_a_batch_file_of_embedding_lines_runs_through_the_routes(tmp_path):
    llm = FakeEmbeddingLLM()

    def line(custom_id: str, url: str, body: dict) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})

    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([
        line("one", "/v1/embeddings", {"input": "hello world"}),
        line("many", "/v1/embeddings", {"input": ["a", "b c"], "encoding_format": "base64", "dimensions": 4}),
        line("empty", "/v1/embeddings", {"input": ""}),
        line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]) + "\n")
    output = tmp_path / "out.jsonl"
    summary = run_batch_file(llm, source, output, served_model_name=MODEL, progress=False)
    records = {record["custom_id"]: record for record in map(json.loads, output.read_text().splitlines())}
    assert sorted(records) == ["chat", "empty", "many", "one"] and (summary.succeeded, summary.failed) == (2, 2)
    one = records["one"]["response"]
    assert one["status_code"] == 200 and records["one"]["error"] is None and records["one"]["id"].startswith("batch_req_")
    assert one["body"]["object"] == "list" and one["body"]["model"] == MODEL
    assert torch.allclose(torch.tensor(one["body"]["data"][0]["embedding"]), llm.vector("hello world"), atol=1e-6)
    many = records["many"]["response"]["body"]["data"]
    decoded = torch.frombuffer(bytearray(base64.b64decode(many[1]["embedding"])), dtype=torch.float32)
    assert torch.allclose(decoded, llm.vector("b c", dimensions=4))
    assert records["empty"]["response"]["status_code"] == 400 and records["empty"]["response"]["body"]["error"]["param"] == "input"
    chat = records["chat"]
    assert chat["response"] is None and chat["error"]["code"] == "unsupported_url"
    assert chat["error"]["message"] == (f"this deployment ({MODEL}) serves no /v1/chat/completions: this model serves "
                                        "embeddings (/v1/embeddings); it does not generate text")
