"""The ensemble's output filter: a blocklist of terms, matched as whole words, ignoring case.

It stands where a safety classifier would: a step between detokenizing and the client. ``redact``
replaces each blocked term with ``[redacted]``; ``refuse`` cuts the text at the first blocked term and
ends it with a refusal (what was streamed before the term cannot be taken back, so the whole answer is
cut the same way).

>>> Blocklist(["secret"], "redact").apply("the Secret is out, secretly")
'the [redacted] is out, secretly'
>>> Blocklist(["secret"], "refuse").apply("the secret is out")
'the [withheld by the output filter]'
>>> Blocklist(["top", "top secret"]).apply("top secret, top")  # the longest term wins
'[redacted], [redacted]'

A stream is filtered as a whole, not piece by piece: ``settled(text)`` is the filtered text of the part of
``text`` that no later text can change, so a term split over two pieces is still found. A piece's
filtered text is ``settled(all so far)`` minus ``settled(all before it)``, which needs no state between
responses (the ensemble's post-processing step gives the text so far):

>>> blocklist = Blocklist(["top secret"])
>>> blocklist.settled("it is top sec"), blocklist.settled("it is top secret"), blocklist.settled("it is top secret!")
('it is ', 'it is ', 'it is [redacted]!')
"""

from __future__ import annotations

import re

from autodeploy.errors import ConfigError

ACTIONS = ("redact", "refuse")
REDACTION = "[redacted]"
REFUSAL = "[withheld by the output filter]"
CONTENT_FILTER = "content_filter"  # OpenAI's finish reason for an answer its filter cut


class Blocklist:
    def __init__(self, terms, action: str = "redact"):
        self.terms = [term.strip() for term in terms if term.strip()]
        if not self.terms:
            raise ConfigError("the blocklist has no terms; give one term a line")
        if action not in ACTIONS:
            raise ConfigError(f"the blocklist action must be one of {', '.join(ACTIONS)}, got {action!r}")
        self.action = action
        # The terms as a trie (a regex alternation is tried term by term: slow for long lists); where two
        # terms match at one place the longer one wins. Lower-cased, so that terms differing only in case
        # share a branch: as two branches, the first would match (ignoring case) and end a longer term early.
        trie: dict = {}
        for term in self.terms:
            node = trie
            for char in term:
                node = node.setdefault(char.lower() if len(char.lower()) == 1 else char, {})
            node[_END] = {}
        self._pattern = re.compile(rf"(?<!\w){_terms(trie)}(?!\w)", re.IGNORECASE)
        # A word start from which the rest of the text is the beginning of a term (or a whole one).
        self._term_start = re.compile(rf"(?<!\w){_beginnings(trie)}\Z", re.IGNORECASE)
        self._longest = max(map(len, self.terms))

    @classmethod
    def from_file(cls, path: str, action: str = "redact") -> Blocklist:
        """One term a line; blank lines and lines starting with ``#`` are skipped."""
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError as error:
            raise ConfigError(f"cannot read the blocklist {path}: {error.strerror}") from None
        return cls([line for line in lines if not line.lstrip().startswith("#")], action)

    def apply(self, text: str) -> str:
        """The filtered text of a whole answer."""
        return self.settled(text, final=True)

    def blocks(self, text: str) -> bool:
        """Whether ``text`` (a whole answer) holds a blocked term."""
        return self._pattern.search(text) is not None

    def settled(self, text: str, final: bool = False) -> str:
        """The filtered text of the part of ``text`` that more text cannot change (all of it when ``final``).

        Held back: the tail from the first place a blocked term may be starting (a word start where the
        rest of the text is the beginning of a term, or a whole term whose next character is not known
        yet). A match that starts before that place is decided, since the text already goes past it;
        so what ``settled`` returns only ever grows as text is appended.
        """
        hold = len(text) if final else self._hold_point(text)
        end, pieces = 0, []
        for match in self._pattern.finditer(text):
            if match.start() >= hold:
                break
            pieces.append(text[end : match.start()])
            if self.action == "refuse":
                return "".join(pieces) + REFUSAL
            pieces.append(REDACTION)
            end = match.end()
        pieces.append(text[end : max(hold, end)])
        return "".join(pieces)

    def filter_response(self, piece: str, text_so_far: str | None, finish_reason: str = "") -> tuple[str, str]:
        """One response of a stream (or a whole answer): the filtered ``piece`` and the finish reason.

        ``text_so_far`` is the answer up to the end of ``piece``, and ``finish_reason`` is "" until the
        last response; the piece sent is ``settled(text so far)`` minus ``settled(text before it)``. Text
        that may be the start of a term waits for the next piece. Without ``text_so_far`` the piece is
        filtered as a whole answer. The last response's finish reason becomes "content_filter" when
        ``refuse`` cut the answer.
        """
        final = text_so_far is None or bool(finish_reason)
        text = piece if text_so_far is None else text_so_far
        filtered = self.settled(text, final)[len(self.settled(text[: len(text) - len(piece)])) :]
        if finish_reason and self.action == "refuse" and self.blocks(text):
            finish_reason = CONTENT_FILTER
        return filtered, finish_reason

    def _hold_point(self, text: str) -> int:
        match = self._term_start.search(text, max(0, len(text) - self._longest))  # the first such start
        return len(text) if match is None else match.start()


_END = ""  # a trie node's key for "a term ends here"


def _either(patterns: list[str]) -> str:
    return patterns[0] if len(patterns) == 1 else f"(?:{'|'.join(patterns)})"


def _terms(node: dict) -> str:
    """The terms below a trie node, a longer one tried first: "top" and "top secret" → ``top(?:\\ secret)?``."""
    branches = [re.escape(char) + _terms(child) for char, child in node.items() if char != _END]
    if not branches:
        return ""
    return f"(?:{_either(branches)})?" if _END in node else _either(branches)


def _beginnings(node: dict) -> str:
    """Every non-empty beginning of a term below a trie node: ``abc`` → ``a(?:b(?:c)?)?``."""
    branches = []
    for char, child in node.items():
        if char != _END:
            rest = _beginnings(child)
            branches.append(re.escape(char) + (f"(?:{rest})?" if rest else ""))
    return _either(branches) if branches else ""
