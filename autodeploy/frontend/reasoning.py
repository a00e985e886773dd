"""Reasoning output: the ``<think>…</think>`` block that reasoning models (Qwen3, DeepSeek-R1, QwQ, …) write
before their answer, split from the answer (``reasoning_content`` in the OpenAI server's chat responses).

The block counts only at the start of the output (after blank text), or from the very start when the prompt
itself opened it (a chat template that ends the generation prompt with ``<think>``, as DeepSeek-R1's does:
``opens_thinking``). Text after ``</think>`` is the answer, its leading blank text dropped; an output cut off
inside the block is all reasoning. ``ReasoningParser`` splits text as it streams; fed at once or piece by
piece, the same text gives the same reasoning and answer (``split_reasoning`` is the whole case).

>>> split_reasoning("<think>\\nThe user greets.\\n</think>\\n\\nHello!")
('\\nThe user greets.\\n', 'Hello!')
>>> split_reasoning("The user greets.</think>Hello!", thinking=True)
('The user greets.', 'Hello!')
>>> split_reasoning("Hello!")
(None, 'Hello!')
"""

from __future__ import annotations

import re

from autodeploy.runtime.request import streamable_prefix

THINK_START = "<think>"
THINK_END = "</think>"
_OPENED = re.compile(re.escape(THINK_START) + r"\s*\Z")

REASONING, CONTENT = "reasoning", "content"


def opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside a think block (its generation starts in the reasoning)."""
    return _OPENED.search(prompt_text) is not None


class ReasoningParser:
    """Split generated text, fed as it streams, into ``(REASONING | CONTENT, text)`` pieces in order.

    Held back: blank text at the start (a think block may follow), a tail that may begin ``<think>`` at
    the start or ``</think>`` inside the block, and blank text right after the block."""

    def __init__(self, thinking: bool = False):
        self._state = REASONING if thinking else "start"
        self._pending = ""
        self._trim = False  # drop blank text before the answer's first character
        self.saw_reasoning = thinking

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._pending += text
        pieces: list[tuple[str, str]] = []
        while True:
            if self._state == "start":
                head = self._pending.lstrip()
                if head.startswith(THINK_START):
                    self._pending, self._state, self.saw_reasoning = head[len(THINK_START):], REASONING, True
                    continue
                if THINK_START.startswith(head):  # blank so far, or a beginning of <think>: wait
                    return pieces
                self._state = CONTENT
                continue
            if self._state == REASONING:
                end = self._pending.find(THINK_END)
                if end < 0:
                    head = streamable_prefix(self._pending, [THINK_END])
                    self._emit(REASONING, head, pieces)
                    self._pending = self._pending[len(head):]
                    return pieces
                self._emit(REASONING, self._pending[:end], pieces)
                self._pending, self._state, self._trim = self._pending[end + len(THINK_END):], CONTENT, True
                continue
            text, self._pending = self._pending, ""
            self._emit(CONTENT, text, pieces)
            return pieces

    def finish(self) -> list[tuple[str, str]]:
        """The rest, once the generation ended (an unfinished think block is reasoning)."""
        pieces: list[tuple[str, str]] = []
        rest, self._pending = self._pending, ""
        self._emit(REASONING if self._state == REASONING else CONTENT, rest, pieces)
        return pieces

    def _emit(self, kind: str, text: str, pieces: list) -> None:
        if kind == CONTENT and self._trim:
            text = text.lstrip()
            self._trim = not text
        if text:
            pieces.append((kind, text))


def split_reasoning(text: str, thinking: bool = False) -> tuple[str | None, str | None]:
    """``(reasoning, answer)`` of a whole output: None for a part it does not have."""
    parser = ReasoningParser(thinking)
    pieces = parser.feed(text) + parser.finish()
    reasoning = "".join(t for kind, t in pieces if kind == REASONING)
    content = "".join(t for kind, t in pieces if kind == CONTENT)
    return (reasoning if parser.saw_reasoning else None), (content or None)
