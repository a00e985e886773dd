"""Retrieval-augmented generation with two autodeploy servers and a faiss index (docs/embeddings.md).

An embedding model served by ``autodeploy serve`` embeds the passages into a faiss inner-product index (its vectors
are normalized, so inner product is cosine similarity); a question is embedded the same way, its ``k`` nearest passages
retrieved, and a language model served by another ``autodeploy serve`` answers from them. Everything goes through the
official ``openai`` client, as any OpenAI-compatible application would.

    autodeploy serve BAAI/bge-small-en-v1.5 --port 8001 &
    autodeploy serve Qwen/Qwen2.5-0.5B-Instruct --port 8002 &
    pip install faiss-cpu openai
    python docs/rag_example.py --embedder http://127.0.0.1:8001/v1 --generator http://127.0.0.1:8002/v1 \\
        --passages passages.txt "How are keys and values kept?"

``passages.txt``: one passage a line. tests/test_rag_example.py runs this file's functions on two tiny models.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import faiss
import numpy as np
from openai import OpenAI


@dataclass
class Retriever:
    """Passages and their faiss index, embedded by the server behind ``client``."""

    client: OpenAI
    model: str
    passages: list[str]
    index: faiss.IndexFlatIP

    @classmethod
    def build(cls, client: OpenAI, model: str, passages: list[str], batch: int = 256) -> Retriever:
        vectors = [embed(client, model, passages[i:i + batch]) for i in range(0, len(passages), batch)]
        matrix = np.concatenate(vectors)
        index = faiss.IndexFlatIP(matrix.shape[1])
        index.add(matrix)
        return cls(client, model, passages, index)

    def search(self, question: str, k: int = 3) -> list[tuple[int, float]]:
        """The ``k`` passages nearest ``question``: (passage index, similarity), nearest first."""
        similarities, indices = self.index.search(embed(self.client, self.model, [question]), k)
        return [(int(i), float(s)) for i, s in zip(indices[0], similarities[0]) if i >= 0]


def embed(client: OpenAI, model: str, texts: list[str]) -> np.ndarray:
    """``texts``' vectors from ``/v1/embeddings`` (float32, one row a text, in order)."""
    data = client.embeddings.create(model=model, input=texts).data
    return np.asarray([item.embedding for item in sorted(data, key=lambda item: item.index)], dtype=np.float32)


def prompt_for(question: str, passages: list[str]) -> str:
    context = "\n".join(f"[{i + 1}] {passage}" for i, passage in enumerate(passages))
    return f"Answer from these passages.\n{context}\nQuestion: {question}\nAnswer:"


def answer(retriever: Retriever, generator: OpenAI, model: str, question: str, k: int = 3, max_tokens: int = 64) -> tuple[str, str]:
    """The generator's answer to ``question`` from its ``k`` retrieved passages, and the prompt it read."""
    passages = [retriever.passages[i] for i, _ in retriever.search(question, k)]
    prompt = prompt_for(question, passages)
    completion = generator.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return completion.choices[0].text, prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question")
    parser.add_argument("--embedder", required=True, help="the embedding server's base URL (…/v1)")
    parser.add_argument("--generator", required=True, help="the language model server's base URL (…/v1)")
    parser.add_argument("--passages", required=True, help="a text file, one passage a line")
    parser.add_argument("-k", type=int, default=3)
    args = parser.parse_args()
    embedder, generator = OpenAI(base_url=args.embedder, api_key="none"), OpenAI(base_url=args.generator, api_key="none")
    passages = [line.strip() for line in open(args.passages, encoding="utf-8") if line.strip()]
    retriever = Retriever.build(embedder, embedder.models.list().data[0].id, passages)
    text, _ = answer(retriever, generator, generator.models.list().data[0].id, args.question, args.k)
    print(text.strip())


if __name__ == "__main__":
    main()
