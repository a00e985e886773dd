"""docs/rag_example.py end to end on the CPU: a tiny BERT embedder and a tiny Llama, each behind `autodeploy serve`'s app,
a faiss index of the embedder's vectors; retrieval equals the nearest passages by llm.embed, and the answer equals the
generator's own greedy completion of the prompt built from them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from autodeploy import SamplingParams, autodeploy
from autodeploy.serve.app import ServerOptions, build_app
from autodeploy.serve.server import serving_in_thread
from tests.tiny_encoders import write_sentence_transformer
from tests.tiny_models import write_tiny_checkpoint

pytest.importorskip("faiss")
openai = pytest.importorskip("openai")
PASSAGES = ["paged attention keeps keys and values in blocks of tokens", "the quick brown fox jumps over the lazy dog",
            "an embedding model reads a whole text at once", "a reranker scores how well a document answers a query",
            "the lazy dog sleeps", "values in blocks"]


def _example():
    spec = importlib.util.spec_from_file_location("rag_example", Path(__file__).resolve().parents[1] / "docs" / "rag_example.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_retrieval_then_generation_through_both_servers(tmp_path):
    rag = _example()
    embedder = autodeploy(str(write_sentence_transformer(tmp_path / "embed")), device="cpu", dtype="float32")
    write_tiny_checkpoint("llama", tmp_path / "llama")
    generator = autodeploy(str(tmp_path / "llama"), device="cpu", dtype="float32")
    question = "where are keys and values kept"
    with serving_in_thread(build_app(embedder, ServerOptions(served_model_name="embed"))) as embed_url, \
            serving_in_thread(build_app(generator, ServerOptions(served_model_name="llama"))) as generate_url:
        clients = [openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) for url in (embed_url, generate_url)]
        retriever = rag.Retriever.build(clients[0], "embed", PASSAGES, batch=4)
        found = retriever.search(question, k=2)
        text, prompt = rag.answer(retriever, clients[1], "llama", question, k=2, max_tokens=8)
    vectors = embedder.embed(PASSAGES).vectors
    similarity = vectors @ embedder.embed(question).vectors[0]
    nearest = torch.argsort(similarity, descending=True)[:2].tolist()
    assert [i for i, _ in found] == nearest
    assert [s for _, s in found] == pytest.approx(similarity[nearest].tolist(), abs=1e-5)
    assert prompt == rag.prompt_for(question, [PASSAGES[i] for i in nearest])
    assert text == generator.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
