"""Encoder-only models served as embedders and cross-encoders (issue 45): packed texts against Hugging Face run on each
text alone, sentence-transformers' ``encode`` and ``CrossEncoder.predict``, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from autodeploy import autodeploy
from autodeploy.errors import ConfigError, InvalidRequestError, UnsupportedModelError
from tests.tiny_encoders import write_sentence_transformer, write_tiny_encoder
from tests.tiny_models import write_tiny_checkpoint

TEXTS = ["the quick brown fox", "paged attention keeps keys and values in blocks of tokens", "a", "an embedding model reads"]


def _hf_rows(model, tokenizer, texts):
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").to(model.device)
            rows.append(model(**ids).last_hidden_state[0])
    return rows


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_packed_texts_pool_as_hugging_face_computes_each_alone(tmp_path, kind):
    model = write_tiny_encoder(tmp_path, kind)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32")
    assert llm.tasks == {"embed"} and "hidden state" in str(llm.verification)
    rows = _hf_rows(model, llm.tokenizer, TEXTS)
    expected = {"cls": torch.stack([r[0] for r in rows]), "mean": torch.stack([r.mean(0) for r in rows]),
                "last": torch.stack([r[-1] for r in rows])}
    for pooling, want in expected.items():
        got = llm.embed(TEXTS, pooling=pooling, normalize=False)
        torch.testing.assert_close(got.vectors, want, atol=2e-5, rtol=1e-4)
    default = llm.embed(TEXTS)  # the model's own: [CLS], normalized
    torch.testing.assert_close(default.vectors, F.normalize(expected["cls"], dim=-1), atol=2e-5, rtol=1e-4)
    assert default.num_tokens == [len(r) for r in rows]
    short = llm.embed(TEXTS, dimensions=16)  # Matryoshka: the leading components, then normalized
    torch.testing.assert_close(short.vectors, F.normalize(expected["cls"][:, :16], dim=-1), atol=2e-5, rtol=1e-4)
    ids = llm.tokenizer(TEXTS[1])["input_ids"]
    torch.testing.assert_close(llm.embed(ids).vectors[0], default.vectors[1])  # token ids as given


def test_a_token_budget_splits_texts_over_forwards_with_the_same_vectors(tmp_path):
    """A forward holds at most the budget's tokens; a text longer than the budget (not than the model) runs alone."""
    write_tiny_encoder(tmp_path)
    texts = [*TEXTS * 5, [7] * 40, [9]]
    whole = autodeploy(str(tmp_path), device="cpu", dtype="float32").embed(texts)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32", scheduler={"max_num_tokens": 24}, verify={"enabled": False})
    split = llm.embed(texts)
    assert llm.embedder.forwards > 3
    torch.testing.assert_close(split.vectors, whole.vectors, atol=1e-5, rtol=1e-5)


def _write_tiny_modernbert(directory, **overrides) -> torch.nn.Module:
    """A tiny random ModernBERT (RoPE, no token types) saved without a tokenizer; the float32 eval-mode model, eager
    attention (its additive masks, not the SDPA path the deployment is matched from)."""
    from transformers import AutoModel, ModernBertConfig

    config = ModernBertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
                              max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=3,
                              sep_token_id=4, **overrides)
    torch.manual_seed(0)
    model = AutoModel.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # norms away from 1, so a dropped one shows
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.1)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("local_attention,global_every", [(16, 2), (10, 3)])
def test_modernbert_local_layers_keep_their_window_within_each_packed_text(tmp_path, local_attention, global_every):
    """ModernBERT: every ``global_every``-th layer sees the whole text, the others the keys within ``local_attention // 2``
    of each query (a bidirectional sliding window). Texts of 5 to 40 tokens, most longer than the window, packed into
    one forward: each text's vectors are Hugging Face's for that text alone."""
    model = _write_tiny_modernbert(tmp_path, local_attention=local_attention, global_attn_every_n_layers=global_every)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32")
    assert llm.tasks == {"embed"} and "hidden state" in str(llm.verification)
    windows = [node.kwargs.get("window") for node in llm.embedder.graph.graph.nodes
               if str(node.target).startswith("autodeploy.bidirectional_attention")]
    assert windows == [None if layer % global_every == 0 else local_attention // 2 for layer in range(3)]
    generator = torch.Generator().manual_seed(1)
    texts = [[3, *torch.randint(5, 300, (length - 2,), generator=generator).tolist(), 4] for length in (5, 40, 17, 9, 33, 12)]
    with torch.no_grad():
        rows = [model(input_ids=torch.tensor([text])).last_hidden_state[0] for text in texts]
    for pooling, pick in (("cls", lambda r: r[0]), ("mean", lambda r: r.mean(0))):
        got = llm.embed(texts, pooling=pooling, normalize=False)
        torch.testing.assert_close(got.vectors, torch.stack([pick(r) for r in rows]), atol=2e-5, rtol=1e-4)
    assert llm.embedder.forwards == 2 and got.num_tokens == [len(text) for text in texts]  # one forward a call


def test_a_modernbert_reranker_is_refused_by_name(tmp_path):
    """Its classification head (a prediction head, then the classifier over the [CLS] row or the mean) is not the score
    graph's BERT or RoBERTa head."""
    from transformers import AutoModelForSequenceClassification, ModernBertConfig

    config = ModernBertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                              max_position_embeddings=128, pad_token_id=0, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="ModernBertForSequenceClassification's classification head"):
        autodeploy(str(tmp_path), device="cpu")


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False), ("lasttoken", True)])
def test_sentence_transformers_folders_embed_as_encode_does(tmp_path, pooling, normalize):
    from sentence_transformers import SentenceTransformer

    folder = write_sentence_transformer(tmp_path, pooling, normalize)
    want = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    llm = autodeploy(str(folder), device="cpu", dtype="float32")
    torch.testing.assert_close(llm.embed(TEXTS).vectors, want.float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_cross_encoders_score_pairs_as_hugging_face(tmp_path, kind):
    model = write_tiny_encoder(tmp_path, kind, task="score")
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32")
    assert llm.tasks == {"score"} and "score logit" in str(llm.verification)
    query, documents = "what keeps keys and values", ["paged attention", "the lazy dog", "blocks of tokens keep values"]
    with torch.no_grad():
        pairs = llm.tokenizer([query] * 3, documents, return_tensors="pt", padding=True)
        want = torch.sigmoid(model(**pairs).logits[:, 0])
    got = llm.score(query, documents)
    torch.testing.assert_close(torch.tensor(got.scores), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(llm.score(query, documents[1]).scores), want[1:2], atol=2e-5, rtol=1e-4)  # one pair
    assert got.num_tokens == [int(n) for n in pairs["attention_mask"].sum(1)]


def test_cross_encoder_scores_equal_sentence_transformers_cross_encoder(tmp_path):
    from sentence_transformers import CrossEncoder

    write_tiny_encoder(tmp_path, task="score")
    pairs = [("what keeps keys", "paged attention"), ("what keeps keys", "the quick brown fox")]
    want = CrossEncoder(str(tmp_path), device="cpu").predict(pairs)
    got = autodeploy(str(tmp_path), device="cpu", dtype="float32").score(pairs[0][0], [d for _, d in pairs]).scores
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want).float(), atol=2e-5, rtol=1e-4)


def test_bad_inputs_are_refused_before_anything_runs(tmp_path):
    write_tiny_encoder(tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32")
    cases = {"is 65 tokens; this model reads at most 64": [[5] * 65], "is an empty string": ["fine", ""],
             "outside the vocabulary": [[5, 999]], "no input": [], "is empty": [[]],
             "neither a string nor a list of token ids": [3.5]}
    for message, inputs in cases.items():
        with pytest.raises(InvalidRequestError, match=message):
            llm.embed(inputs)
    with pytest.raises(InvalidRequestError, match="dimensions must be between 1 and the model's 64"):
        llm.embed("a", dimensions=65)
    with pytest.raises(InvalidRequestError, match="pooling must be one of"):
        llm.embed("a", pooling="max")
    assert llm.embedder.forwards == 0
    for call in (lambda: llm.generate("a"), lambda: llm.score("a", ["b"])):
        with pytest.raises(UnsupportedModelError, match="embeds texts"):
            call()


def test_a_language_model_refuses_to_embed(tmp_path):
    write_tiny_checkpoint("llama", tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32")
    assert llm.tasks == {"generate"}
    with pytest.raises(UnsupportedModelError, match="generates text"):
        llm.embed("def f(x):")


def test_encoders_that_cannot_be_served_are_refused_by_name(tmp_path):
    write_tiny_encoder(tmp_path / "two", task="score", num_labels=2)
    with pytest.raises(UnsupportedModelError, match="2 labels"):
        autodeploy(str(tmp_path / "two"), device="cpu")
    folder = write_sentence_transformer(tmp_path / "st")
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match="Dense module"):
        autodeploy(str(folder), device="cpu")
    (folder / "modules.json").write_text(json.dumps(modules[:3]))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    with pytest.raises(UnsupportedModelError, match="max pooling"):
        autodeploy(str(folder), device="cpu")


def test_an_encoder_without_packed_attention_is_refused(tmp_path):
    write_tiny_encoder(tmp_path)
    with pytest.raises(ConfigError, match="pack_bidirectional_attention"):
        autodeploy(str(tmp_path), device="cpu", verify={"enabled": False},
                   transforms={"pack_bidirectional_attention": {"enabled": False}}).embed("a")


def test_the_server_serves_a_real_embedder_and_reranker_through_their_clients(tmp_path):
    """The tiny BERT embedder behind /v1/embeddings, through the official openai client (base64, its default), and the
    tiny cross-encoder behind /v1/rerank, against the same LLM called directly."""
    import httpx
    import openai

    from autodeploy.serve.app import ServerOptions, build_app
    from autodeploy.serve.server import serving_in_thread

    write_tiny_encoder(tmp_path / "embed")
    write_tiny_encoder(tmp_path / "score", task="score")
    embedder = autodeploy(str(tmp_path / "embed"), device="cpu", dtype="float32")
    with serving_in_thread(build_app(embedder, ServerOptions(served_model_name="tiny-bert"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        answer = client.embeddings.create(model="tiny-bert", input=TEXTS)
        served = torch.tensor([item.embedding for item in answer.data])
        assert answer.usage.prompt_tokens == sum(embedder.embed(TEXTS).num_tokens)
    torch.testing.assert_close(served, embedder.embed(TEXTS).vectors, atol=1e-6, rtol=1e-6)
    reranker = autodeploy(str(tmp_path / "score"), device="cpu", dtype="float32")
    documents = ["the lazy dog", "paged attention keeps keys", "blocks of tokens"]
    with serving_in_thread(build_app(reranker, ServerOptions(served_model_name="tiny-reranker"))) as url:
        results = httpx.post(f"{url}/v1/rerank", json={"query": "what keeps keys", "documents": documents, "top_n": 2},
                             timeout=60).json()["results"]
    scores = reranker.score("what keeps keys", documents).scores
    ranked = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [r["index"] for r in results] == ranked
    assert [r["relevance_score"] for r in results] == pytest.approx([scores[i] for i in ranked], abs=1e-6)


def test_the_autotuner_times_packed_attention_with_its_seq_start(tmp_path):
    # The packed node's seq_start is a keyword argument and an integer tensor: the tuner must pass a valid one (texts of
    # TUNING_TEXT_TOKENS), not drop it (it once timed unpacked attention, and the varlen kernel, given None, was excluded).
    from autodeploy.custom_ops import op_by_target
    from autodeploy.custom_ops.bidirectional_attention import TUNING_TEXT_TOKENS
    from autodeploy.transforms.select_kernels import _Problem, _signature, _TokenShapes

    write_tiny_encoder(tmp_path)
    gm = autodeploy(str(tmp_path), device="cpu", dtype="float32").embedder.graph
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and (found := op_by_target(n.target)) is not None
                and found[0].name == "bidirectional_attention")
    problem = _Problem(node, gm, _TokenShapes(gm), torch.device("cpu"))
    assert problem.tunable() is None
    q, k, v, scale, bias, seq_start = problem.make_inputs(300)
    assert q.shape[1] == 300 and bias is None
    assert seq_start.dtype == torch.int32 and seq_start.tolist() == [0, TUNING_TEXT_TOKENS, 2 * TUNING_TEXT_TOKENS, 300]
    packed = torch.ops.autodeploy.bidirectional_attention(q, k, v, scale, None, seq_start)
    first = torch.ops.autodeploy.bidirectional_attention(q[:, :128], k[:, :128], v[:, :128], scale)
    torch.testing.assert_close(packed[:, :128], first)  # the problem timed is the packed one: texts kept apart
    assert any("tensor" in str(a) and "int32" in str(a) for a in _signature(node, gm, _TokenShapes(gm)))

    class Unpacked(torch.nn.Module):  # a vision tower's attention: seq_start left None stays None
        def forward(self, q, k, v):
            return torch.ops.autodeploy.bidirectional_attention(q, k, v, 0.5, None, None)

    plain = torch.fx.symbolic_trace(Unpacked())
    for placeholder in plain.graph.find_nodes(op="placeholder"):
        placeholder.meta["val"] = torch.empty(1, 4, 2, 8)
    (call,) = [node for node in plain.graph.nodes if node.op == "call_function"]
    call.target = torch.ops.autodeploy.bidirectional_attention.default  # as graphs hold it (tracing records the packet)
    assert _Problem(call, plain, _TokenShapes(plain), torch.device("cpu")).make_inputs(4)[4:] == [None, None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_packed_texts_in_bfloat16_take_the_varlen_kernel_and_match_hugging_face(tmp_path):
    model = write_tiny_encoder(tmp_path).to("cuda", torch.bfloat16)
    llm = autodeploy(str(tmp_path), device="cuda", dtype="bfloat16")  # the twin is verified on the GPU in bfloat16
    chosen = [line for line in llm.pipeline_report().splitlines() if "bidirectional_attention ×" in line]
    rows = _hf_rows(model, llm.tokenizer, TEXTS)
    for pooling, pick in (("mean", lambda r: r.float().mean(0)), ("cls", lambda r: r[0].float())):
        want = torch.stack([pick(r) for r in rows]).cpu()
        torch.testing.assert_close(llm.embed(TEXTS * 8, pooling=pooling, normalize=False).vectors[:4], want, atol=0.05, rtol=0.05)
    # The autotuner times packed texts (seq_start given): the varlen kernel wins, at least at the larger token buckets
    assert chosen and "varlen" in chosen[0], chosen


CODE = ["def fibonacci(n):", "import os\nprint(os.path.join('a', 'b'))", "for i in range(10):\n    print(i * i)", "x"]


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_a_decoder_embedding_model_embeds_as_sentence_transformers_encode(tmp_path, pooling):
    """Qwen3-Embedding's layout: a causal LM's base model in a sentence-transformers folder, each text read causally
    within itself though packed with others."""
    from sentence_transformers import SentenceTransformer

    from tests.tiny_encoders import write_decoder_embedder

    folder = write_decoder_embedder(tmp_path, pooling)
    want = SentenceTransformer(str(folder), device="cpu").encode(CODE, convert_to_tensor=True)
    llm = autodeploy(str(folder), device="cpu", dtype="float32")
    assert llm.tasks == {"embed"} and "hidden state" in str(llm.verification)
    torch.testing.assert_close(llm.embed(CODE).vectors, want.float(), atol=2e-5, rtol=1e-4)
    attention = [line for line in llm.pipeline_report().splitlines() if line.startswith("pack_bidirectional_attention")]
    assert attention and "attentions read seq_start" in attention[0]


@pytest.mark.timeout(300)
def test_embedding_batches_through_the_batch_api_and_from_a_table(tmp_path):
    """An embedding server with --batch-dir runs a /v1/embeddings batch through the openai client's files and batches
    APIs (a completions batch is refused: the model does not generate); `autodeploy batch` reads a Parquet table's
    input column. Every vector equals llm.embed's."""
    import openai
    import pyarrow as pa
    import pyarrow.parquet as pq

    from autodeploy.serve.app import ServerOptions, build_app
    from autodeploy.serve.batch_job import run_batch_file
    from autodeploy.serve.server import serving_in_thread
    from tests.serve.test_batches_api import records, wait_for

    write_tiny_encoder(tmp_path / "embed")
    llm = autodeploy(str(tmp_path / "embed"), device="cpu", dtype="float32")
    want = llm.embed(TEXTS).vectors
    lines = [json.dumps({"custom_id": f"t{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": text}})
             for i, text in enumerate(TEXTS)]
    options = ServerOptions(served_model_name="tiny-bert", batch_dir=str(tmp_path / "batches"))
    with serving_in_thread(build_app(llm, options)) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        uploaded = api.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="endpoint must be one of /v1/embeddings"):
            api.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        batch = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        batch = wait_for(api, batch.id, lambda b: b.status == "completed")
        results = {r["custom_id"]: r for r in records(api, batch.output_file_id)}
    assert sorted(results) == [f"t{i}" for i in range(len(TEXTS))]
    served = torch.tensor([results[f"t{i}"]["response"]["body"]["data"][0]["embedding"] for i in range(len(TEXTS))])
    torch.testing.assert_close(served, want, atol=1e-6, rtol=1e-6)

    pq.write_table(pa.table({"text": TEXTS, "doc": [f"d{i}" for i in range(len(TEXTS))]}), tmp_path / "texts.parquet")
    run_batch_file(llm, tmp_path / "texts.parquet", tmp_path / "out.jsonl", served_model_name="tiny-bert", progress=False,
                   columns={"input": "text", "custom_id": "doc"})
    table = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    served = torch.tensor([table[f"d{i}"]["response"]["body"]["data"][0]["embedding"] for i in range(len(TEXTS))])
    torch.testing.assert_close(served, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("task", ["embed", "score", "decoder"])
def test_a_saved_embedder_or_reranker_serves_the_same_after_a_reload(tmp_path, task):
    from tests.tiny_encoders import write_decoder_embedder

    if task == "decoder":
        folder, task = write_decoder_embedder(tmp_path), "embed"
    else:
        folder = tmp_path / "model"
        write_tiny_encoder(folder, task=task)
    llm = autodeploy(str(folder), device="cpu", dtype="float32")
    llm.save(tmp_path / "saved")
    reloaded = autodeploy(str(tmp_path / "saved"))
    assert reloaded.tasks == {task} and reloaded.deployment.embedding == llm.deployment.embedding
    if task == "embed":
        torch.testing.assert_close(reloaded.embed(TEXTS).vectors, llm.embed(TEXTS).vectors, atol=0, rtol=0)
    else:
        assert reloaded.score("what keeps keys", ["paged attention", "a dog"]).scores == \
            llm.score("what keeps keys", ["paged attention", "a dog"]).scores
        assert len(reloaded.score("what keeps keys", "one document").scores) == 1


def test_many_texts_are_tokenized_a_chunk_at_a_time_with_the_same_vectors_and_errors(tmp_path, monkeypatch):
    """Above EMBED_CHUNK texts, the next chunk is tokenized while this one runs: the vectors are those of one chunk, and
    a bad text in a later chunk is named by its index in the call."""
    import autodeploy.frontend.llm as llm_module

    write_tiny_encoder(tmp_path)
    llm = autodeploy(str(tmp_path), device="cpu", dtype="float32")
    texts = [f"{TEXTS[i % 4]} {i}" for i in range(11)]
    whole = llm.embed(texts)
    monkeypatch.setattr(llm_module, "EMBED_CHUNK", 3)
    chunked = llm.embed(texts)
    torch.testing.assert_close(chunked.vectors, whole.vectors)
    assert chunked.num_tokens == whole.num_tokens
    with pytest.raises(InvalidRequestError, match="input 9 is 65 tokens"):
        llm.embed([*texts[:9], [5] * 65, "x"])


def test_sentence_transformers_prompts_are_put_before_string_inputs_as_encode_does(tmp_path):
    from sentence_transformers import SentenceTransformer

    folder = write_sentence_transformer(tmp_path)
    config_file = folder / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text())
    config["prompts"] = {"query": "a reranker scores ", "document": ""}
    config_file.write_text(json.dumps(config))
    reference = SentenceTransformer(str(folder), device="cpu")
    llm = autodeploy(str(folder), device="cpu", dtype="float32")
    for name in ("query", "document"):
        want = reference.encode(TEXTS, prompt_name=name, convert_to_tensor=True)
        torch.testing.assert_close(llm.embed(TEXTS, prompt_name=name).vectors, want.float(), atol=2e-5, rtol=1e-4)
    want = reference.encode(TEXTS, prompt="the lazy ", convert_to_tensor=True)
    torch.testing.assert_close(llm.embed(TEXTS, prompt="the lazy ").vectors, want.float(), atol=2e-5, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="'passage' is not one of this model's prompts \\('query', 'document'\\)"):
        llm.embed(TEXTS, prompt_name="passage")

    config["default_prompt_name"] = "query"  # every input gets it unless another is named
    config_file.write_text(json.dumps(config))
    reference = SentenceTransformer(str(folder), device="cpu")
    llm = autodeploy(str(folder), device="cpu", dtype="float32")
    torch.testing.assert_close(llm.embed(TEXTS).vectors, reference.encode(TEXTS, convert_to_tensor=True).float(),
                               atol=2e-5, rtol=1e-4)
    pooling_file = folder / "1_Pooling" / "config.json"
    pooling_file.write_text(json.dumps({**json.loads(pooling_file.read_text()), "include_prompt": False}))
    with pytest.raises(UnsupportedModelError, match="leaves the prompt's rows out"):
        autodeploy(str(folder), device="cpu", dtype="float32")
