"""The text of a completion that grows a token at a time, decoding only what is new.

Decoding the whole output at every step (what a stream, or a request with stop strings, needs) costs
O(n²) over a request: the profile of the server at 64 streams put a fifth of the engine thread there.
``IncrementalDetokenizer`` keeps the text decoded so far and decodes a window from the previous
boundary: the new text is ``decode(window)`` minus ``decode(window's old tokens)``, so the tokenizer
sees the new tokens with the context that sets their spacing (SentencePiece's leading ``▁``, byte-level
pieces of one character). A window that ends in a partial UTF-8 character is not committed until the
character completes. Tokenizers that rewrite spaces across tokens (``clean_up_tokenization_spaces``)
are decoded whole, as before: a window could not see a rewrite that spans its start.

    detokenizer = IncrementalDetokenizer(tokenizer)
    for step in range(1, len(ids) + 1):
        assert detokenizer.text(ids[:step]) == tokenizer.decode(ids[:step], skip_special_tokens=True)
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.incremental = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._ids: list[int] = []  # the tokens whose text is committed
        self._text = ""
        self._window_start = 0  # the next window's first token: from there to the committed end is its context

    def text(self, ids: list[int]) -> str:
        """``tokenizer.decode(ids, skip_special_tokens=True)``, from what earlier calls decoded when ``ids``
        extends their tokens (anything else starts over: beams are reordered, for one)."""
        if not self.incremental:
            return self._decode(ids)
        committed = len(self._ids)
        if len(ids) < committed or ids[:committed] != self._ids:
            self._ids, self._text, self._window_start = [], "", 0
            committed = 0
        if len(ids) == committed:
            return self._text
        context = self._decode(ids[self._window_start:committed])
        window = self._decode(ids[self._window_start:])
        if not window.startswith(context):  # the new tokens changed how the context decodes
            return self._decode(ids)
        new = window[len(context):]
        if new.endswith("\ufffd"):  # half a character: the next token completes it
            return self._text + new
        self._text += new
        if new:  # the next window's context must have text, or nothing would set its first token's spacing
            self._window_start = committed
        self._ids = list(ids)
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
