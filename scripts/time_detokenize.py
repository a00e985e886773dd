"""Text of a streamed completion after every token: decoding the whole output each step against
``IncrementalDetokenizer`` (runtime/detokenizer.py), with the demo model's tokenizer, at 32 / 128 / 512 tokens.

    .venv/bin/python scripts/time_detokenize.py
"""

import time
from pathlib import Path

from transformers import AutoTokenizer

import autodeploy
from autodeploy.runtime.detokenizer import IncrementalDetokenizer

REPEATS = 5


def seconds(step) -> float:
    start = time.perf_counter()
    for _ in range(REPEATS):
        step()
    return (time.perf_counter() - start) / REPEATS


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(Path(autodeploy.__file__).parent / "assets" / "tiny-code-llama")
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 40
    for n in (32, 128, 512):
        ids = tokenizer(text).input_ids[:n]

        def whole() -> None:
            for end in range(1, n + 1):
                tokenizer.decode(ids[:end], skip_special_tokens=True)

        def incremental() -> None:
            detokenizer = IncrementalDetokenizer(tokenizer)
            for end in range(1, n + 1):
                detokenizer.text(ids[:end])

        full, new = seconds(whole), seconds(incremental)
        print(f"{n:4d} tokens: whole output every step {full * 1e3:6.1f} ms ({full / n * 1e6:3.0f} µs a token), "
              f"incremental {new * 1e3:5.1f} ms ({new / n * 1e6:3.0f} µs a token): {full / new:.1f}×")


if __name__ == "__main__":
    main()
