"""Reasoning output split from the answer: ``<think>…</think>`` at the start (or opened by the prompt),
streamed in any pieces alike."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy.frontend.reasoning import CONTENT, REASONING, ReasoningParser, opens_thinking, split_reasoning


def test_the_think_block_is_reasoning_and_the_rest_the_answer():
    assert split_reasoning("  <think>plan</think>\n\nanswer <think>x</think>") == ("plan", "answer <think>x</think>")
    assert split_reasoning("<think>cut off by max_tokens") == ("cut off by max_tokens", None)
    assert split_reasoning("no block here </think>") == (None, "no block here </think>")
    assert split_reasoning("plan</think>answer", thinking=True) == ("plan", "answer")
    assert split_reasoning("<think></think>answer") == ("", "answer")
    assert opens_thinking("<|im_start|>assistant\n<think>\n") and not opens_thinking("<think>x</think>\n")


def test_stream_pieces_hold_back_a_possible_tag():
    parser = ReasoningParser()
    assert parser.feed("<thi") == [] and parser.feed("nk>a</th") == [(REASONING, "a")]
    assert parser.feed("ink>\n") == [] and parser.feed(" b") == [(CONTENT, "b")] and parser.finish() == []


TEXT = st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "a", "b c", "\n", " "]), max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(TEXT, st.booleans(), st.data())
def test_any_split_of_a_stream_gives_the_whole_texts_split(text, thinking, data):
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))
    parser, pieces = ReasoningParser(thinking), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        pieces += parser.feed(text[a:b])
    pieces += parser.finish()
    reasoning, content = split_reasoning(text, thinking)
    assert "".join(t for kind, t in pieces if kind == REASONING) == (reasoning or "")
    assert "".join(t for kind, t in pieces if kind == CONTENT) == (content or "")
