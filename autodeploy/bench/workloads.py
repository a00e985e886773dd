"""Benchmark workloads: which requests arrive when.

- **synthetic**: ``batch`` requests of exactly ``input_len`` random tokens and ``output_len`` output
  tokens, all arriving at once (a closed batch); EOS is ignored so every request produces its length.
- **poisson**: ``num_requests`` requests arriving by a Poisson process at ``rate`` requests/s.
- **concurrency**: the same kind of requests, all queued at once but at most ``max_concurrency`` in
  flight (a closed loop: a new one starts when one finishes).

Realistic requests draw their lengths from a distribution (``"fixed:128"``, ``"uniform:64:512"``,
``"normal:256:64"``) or come from a JSONL file, one request per line: ``{"prompt": "…"}`` or
``{"prompt_token_ids": [...]}``, optionally with ``"output_len"``. A vision-language model's requests may carry
images (``with_images``: N random images of a given size each, or one image everywhere). Everything is seeded. Every check
(rates, lengths against ``max_seq_len``, the file's format and contents) happens when the workload is
built, before anything runs.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from autodeploy.errors import ConfigError


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival: float = 0.0  # seconds after the run starts
    images: list[bytes] = field(default_factory=list)  # encoded images (a vision-language model's), one placeholder each

    @property
    def prompt(self):
        """What the engine takes: the token ids, with the images beside them when there are any."""
        return {"prompt": list(self.prompt_token_ids), "images": list(self.images)} if self.images else list(self.prompt_token_ids)


@dataclass
class Workload:
    kind: str  # "synthetic" | "poisson" | "concurrency"
    requests: list[BenchRequest]
    description: dict[str, Any] = field(default_factory=dict)
    max_concurrency: int | None = None

    @property
    def id(self) -> str:
        d = self.description
        images = f"-img{d['images_per_request']}x{d['image_size']}{'-same' if d['same_image'] else ''}" if d.get("images_per_request") else ""
        if self.kind == "synthetic":
            return f"synthetic/b{d['batch']}-in{d['input_len']}-out{d['output_len']}{images}"
        point = f"rate{d['rate']:g}" if self.kind == "poisson" else f"c{d['max_concurrency']}"
        return f"{self.kind}/{point}-n{d['num_requests']}-in{d['input_len']}-out{d['output_len']}{images}"


def with_images(workload: Workload, per_request: int, size: int, image_token_id: int, tokens_per_image: int,
                max_seq_len: int, same_image: bool = False, seed: int = 0) -> Workload:
    """``workload`` with ``per_request`` images of ``size`` × ``size`` random pixels (JPEG, as clients send them) before
    each prompt, one placeholder token each; every request's own images, or with ``same_image`` one image everywhere
    (the encoder cache's best case)."""
    if per_request < 1 or size < 1:
        raise ConfigError(f"images per request and image size must be ≥ 1, got {per_request} and {size}")
    rng = np.random.default_rng(seed)
    shared = [_jpeg(rng, size) for _ in range(per_request)] if same_image else None
    requests = []
    for index, request in enumerate(workload.requests):
        _check_fits(len(request.prompt_token_ids) + per_request * tokens_per_image, request.output_len, max_seq_len,
                    f"request {index} with {per_request} image(s) of {tokens_per_image} tokens")
        images = shared or [_jpeg(rng, size) for _ in range(per_request)]
        requests.append(BenchRequest([image_token_id] * per_request + request.prompt_token_ids, request.output_len,
                                     request.arrival, images))
    description = {**workload.description, "images_per_request": per_request, "image_size": size, "same_image": same_image}
    return Workload(workload.kind, requests, description, workload.max_concurrency)


def _jpeg(rng: np.random.Generator, size: int) -> bytes:
    from PIL import Image

    encoded = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(encoded, format="JPEG", quality=90)
    return encoded.getvalue()


@dataclass(frozen=True)
class LengthDistribution:
    """``fixed:N``, ``uniform:LOW:HIGH`` (inclusive) or ``normal:MEAN:STD`` (rounded, at least 1)."""

    spec: str

    def __post_init__(self):
        kind, *values = str(self.spec).split(":")
        try:
            numbers = [float(v) for v in values]
        except ValueError:
            numbers = None
        arity = {"fixed": 1, "uniform": 2, "normal": 2}
        if kind not in arity or numbers is None or len(numbers) != arity[kind] or any(n < 0 for n in numbers):
            raise ConfigError(
                f"length distribution {self.spec!r} is not one of fixed:N, uniform:LOW:HIGH, normal:MEAN:STD (non-negative numbers)"
            )
        if kind == "uniform" and numbers[0] > numbers[1]:
            raise ConfigError(f"length distribution {self.spec!r}: LOW must be ≤ HIGH")
        if self.upper_bound() < 1:
            raise ConfigError(f"length distribution {self.spec!r} never gives a length ≥ 1")

    @property
    def _parts(self) -> tuple[str, list[float]]:
        kind, *values = self.spec.split(":")
        return kind, [float(v) for v in values]

    def sample(self, rng: random.Random) -> int:
        kind, values = self._parts
        if kind == "fixed":
            return int(values[0])
        if kind == "uniform":
            return rng.randint(int(values[0]), int(values[1]))
        return max(1, round(rng.gauss(values[0], values[1])))

    def upper_bound(self) -> float:
        """The largest length it can give (normal: mean + 4 std, the lengths the check must allow)."""
        kind, values = self._parts
        return values[0] if kind == "fixed" else values[1] if kind == "uniform" else values[0] + 4 * values[1]


def _random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def _check_fits(input_len: int, output_len: int, max_seq_len: int, what: str) -> None:
    if output_len < 1 or input_len < 1:
        raise ConfigError(f"{what}: input and output lengths must be ≥ 1 (got {input_len} and {output_len})")
    if input_len + output_len > max_seq_len:
        raise ConfigError(
            f"{what}: {input_len} input + {output_len} output tokens exceed the model's max_seq_len={max_seq_len}; "
            f"shorten them or deploy with a larger max_seq_len"
        )


def synthetic_workload(batch: int, input_len: int, output_len: int, vocab_size: int, max_seq_len: int, seed: int = 0) -> Workload:
    if batch < 1:
        raise ConfigError(f"synthetic workload: batch must be ≥ 1, got {batch}")
    _check_fits(input_len, output_len, max_seq_len, f"synthetic workload b{batch}")
    rng = random.Random(f"synthetic-{seed}-{batch}-{input_len}")
    requests = [BenchRequest(_random_prompt(rng, input_len, vocab_size), output_len) for _ in range(batch)]
    description = {"batch": batch, "input_len": input_len, "output_len": output_len, "seed": seed}
    return Workload("synthetic", requests, description)


def realistic_requests(
    num_requests: int,
    input_len: str,
    output_len: str,
    vocab_size: int,
    max_seq_len: int,
    seed: int = 0,
    dataset: str | Path | None = None,
    tokenizer=None,
) -> list[BenchRequest]:
    """Requests with drawn lengths (or the dataset's prompts), arrival times left at 0."""
    if num_requests < 1:
        raise ConfigError(f"num_requests must be ≥ 1, got {num_requests}")
    rng = random.Random(f"realistic-{seed}")
    outputs = LengthDistribution(output_len)
    if dataset is not None:
        prompts = load_dataset(dataset, tokenizer, vocab_size)
        chosen = [prompts[i % len(prompts)] for i in range(num_requests)]
        requests = [BenchRequest(tokens, fixed if fixed is not None else outputs.sample(rng)) for tokens, fixed in chosen]
    else:
        inputs = LengthDistribution(input_len)
        _check_fits(int(inputs.upper_bound()), int(outputs.upper_bound()), max_seq_len, f"input {input_len} / output {output_len}")
        requests = [BenchRequest(_random_prompt(rng, inputs.sample(rng), vocab_size), outputs.sample(rng)) for _ in range(num_requests)]
    for index, request in enumerate(requests):
        _check_fits(len(request.prompt_token_ids), request.output_len, max_seq_len, f"request {index}")
    return requests


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process with ``rate`` requests/s: exponential gaps, seeded."""
    if not rate > 0:
        raise ConfigError(f"the arrival rate must be > 0 requests/s, got {rate}")
    rng = random.Random(f"poisson-{seed}-{rate}")
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def poisson_workload(requests: list[BenchRequest], rate: float, seed: int, description: dict[str, Any]) -> Workload:
    arrivals = poisson_arrivals(len(requests), rate, seed)
    timed = [BenchRequest(r.prompt_token_ids, r.output_len, t) for r, t in zip(requests, arrivals)]
    return Workload("poisson", timed, {**description, "rate": rate})


def concurrency_workload(requests: list[BenchRequest], max_concurrency: int, description: dict[str, Any]) -> Workload:
    if max_concurrency < 1:
        raise ConfigError(f"max concurrency must be ≥ 1, got {max_concurrency}")
    return Workload("concurrency", list(requests), {**description, "max_concurrency": max_concurrency}, max_concurrency)


def load_dataset(path: str | Path, tokenizer, vocab_size: int) -> list[tuple[list[int], int | None]]:
    """Prompts (token ids) and optional fixed output lengths from a JSONL file."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".json"):
        raise ConfigError(f"workload file {path} has an unknown format {path.suffix or '(none)'!r}; give a .jsonl file with one JSON object per line")
    if not path.is_file():
        raise ConfigError(f"workload file {path} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}:{number} is not valid JSON ({error.msg}); each line must be one JSON object") from None
        if not isinstance(entry, dict) or not ({"prompt", "prompt_token_ids"} & entry.keys()):
            raise ConfigError(f'{path}:{number} needs a "prompt" string or a "prompt_token_ids" list')
        if "prompt_token_ids" in entry:
            tokens = entry["prompt_token_ids"]
            if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and 0 <= t < vocab_size for t in tokens):
                raise ConfigError(f"{path}:{number}: prompt_token_ids must be a non-empty list of ids in [0, {vocab_size})")
        else:
            if tokenizer is None:
                raise ConfigError(f"{path}:{number} has a text prompt but the model has no tokenizer; give prompt_token_ids")
            if not isinstance(entry["prompt"], str) or not entry["prompt"]:
                raise ConfigError(f"{path}:{number}: prompt must be a non-empty string")
            tokens = tokenizer(entry["prompt"]).input_ids
        output_len = entry.get("output_len")
        if output_len is not None and (not isinstance(output_len, int) or output_len < 1):
            raise ConfigError(f"{path}:{number}: output_len must be a positive integer")
        prompts.append((tokens, output_len))
    if not prompts:
        raise ConfigError(f"workload file {path} is empty; it needs at least one request line")
    return prompts
