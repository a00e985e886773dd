"""The Triton ensemble's output filter (``Blocklist``): whole-word terms, ignoring case, redacted or refused,
and a stream filtered as a whole so a term split over pieces is still caught."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy.errors import ConfigError
from autodeploy.serve.triton.blocklist import REDACTION, REFUSAL, Blocklist


def test_blocklist_redacts_whole_words_ignoring_case_or_refuses():
    assert Blocklist(["os", "rm -rf"]).apply("import OS; os.path; cosine; rm -rf /") == "import [redacted]; [redacted].path; cosine; [redacted] /"
    assert Blocklist(["os"], "refuse").apply("import sys, os, re") == f"import sys, {REFUSAL}"
    assert Blocklist(["os"], "refuse").apply("import sys") == "import sys"
    assert Blocklist(["os"], "refuse").blocks("import OS") and not Blocklist(["os"]).blocks("cosine")
    with pytest.raises(ConfigError, match="no terms"):
        Blocklist(["", "  "])
    with pytest.raises(ConfigError, match="action"):
        Blocklist(["os"], "drop")


def test_a_term_split_over_pieces_is_caught():
    blocklist = Blocklist(["secret", "top secret"])
    pieces = ["it is to", "p se", "cr", "et", ", secretly"]
    streamed = texts(stream(blocklist, pieces))
    assert "".join(streamed) == blocklist.apply("".join(pieces)) == "it is [redacted], secretly"
    assert streamed[:4] == ["it is ", "", "", ""]  # "to…" waits until "top secret" is decided


def stream(blocklist: Blocklist, pieces: list[str], finish_reason: str = "length") -> list[tuple[str, str]]:
    """What the filter step sends for each response of a stream of ``pieces``."""
    text, out = "", []
    for i, piece in enumerate(pieces):
        text += piece
        out.append(blocklist.filter_response(piece, text, finish_reason if i == len(pieces) - 1 else ""))
    return out


def texts(responses) -> list[str]:
    return [text for text, _ in responses]


def test_refusal_ends_the_stream_with_finish_reason_content_filter():
    blocklist = Blocklist(["os"], "refuse")
    responses = stream(blocklist, ["import sys, o", "s, re", " and more"], finish_reason="length")
    assert responses == [("import sys, ", ""), (REFUSAL, ""), ("", "content_filter")]
    assert stream(blocklist, ["import sys"], finish_reason="stop") == [("import sys", "stop")]
    assert blocklist.filter_response("import os", None) == (f"import {REFUSAL}", "")  # a lone piece: a whole answer
    assert Blocklist(["os"]).filter_response("os", "import os", "stop") == (REDACTION, "stop")


ALPHABET = "abAB .!é"
terms = st.lists(st.text(ALPHABET, min_size=1, max_size=5).filter(str.strip), min_size=1, max_size=3)


def test_the_longest_term_wins_whatever_the_case_of_the_terms():
    """Found by the property test below: terms that differ in case were separate trie branches, and the
    shorter one's branch matched first."""
    assert Blocklist(["A", "a."]).apply("A.") == REDACTION
    assert Blocklist(["Top", "top secret"]).apply("TOP SECRET!") == REDACTION + "!"
    assert Blocklist(["Top", "top secret"]).settled("it is TOP SEC") == "it is "


@settings(max_examples=400, deadline=None)
@given(terms, st.sampled_from(["redact", "refuse"]), st.text(ALPHABET, max_size=24), st.data())
def test_streamed_pieces_add_up_to_the_whole_answer_filtered(term_list, action, text, data):
    blocklist = Blocklist(term_list, action)
    whole = blocklist.apply(text)
    longest_first = sorted((t.strip() for t in term_list), key=len, reverse=True)
    pattern = re.compile("|".join(rf"(?<!\w){re.escape(t)}(?!\w)" for t in longest_first), re.IGNORECASE)
    if action == "redact":
        assert whole == pattern.sub(REDACTION, text)
    else:
        match = pattern.search(text)
        assert whole == (text if match is None else text[: match.start()] + REFUSAL)
    for i in range(len(text) + 1):  # what is settled only grows, and never shows a term that is not decided
        assert whole.startswith(blocklist.settled(text[:i]))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=6))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert "".join(texts(stream(blocklist, pieces))) == whole
