"""How ``autodeploy run`` prints completions: all at once, or streamed as they are generated.

Every completion prints as the prompt followed by its text, then a ``---`` line with its token count and
finish reason (``--- #i …`` when a request has several). A streamed request with one sample prints only
the prompt and the text, as it arrives.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable

from autodeploy.runtime.outputs import CompletionOutput, RequestOutput
from autodeploy.runtime.sampling_params import SamplingParams


def completion_footer(completion: CompletionOutput, labelled: bool) -> str:
    label = f" #{completion.index}" if labelled else ""
    return f"---{label} {len(completion.token_ids)} tokens, finish: {completion.finish_reason}"


def print_outputs(outputs: list[RequestOutput]) -> None:
    """Every completion of every request, the generated text in bold on a terminal."""
    for output in outputs:
        for completion in output.outputs:
            text = f"\033[1m{completion.text}\033[0m" if sys.stdout.isatty() else completion.text
            print(f"{output.prompt}{text}")
            print(completion_footer(completion, labelled=len(output.outputs) > 1))


def print_stream(chunks: Iterable[RequestOutput], prompt: str, params: SamplingParams) -> RequestOutput:
    """Print one request from ``LLM.stream`` as it comes and return its last (finished) output.

    Several samples (``n`` > 1) are generated together but print one after another, as without
    ``--stream``: the first as its tokens arrive, each later one at once from what it gathered
    meanwhile, then live. Beam search reorders its beams until it ends, so those print at the end.
    """
    if params.beam_width > 1:
        print("beam search: the beams are only known once the search ends; printing them then", file=sys.stderr)
        *_, last = chunks
        print_outputs([last])
        return last
    streamed: dict[int, str] = defaultdict(str)  # each sample's text so far
    latest: dict[int, CompletionOutput] = {}
    live, printed = 0, 0  # the sample on screen and how much of its text is printed
    print(prompt, end="", flush=True)
    for last in chunks:
        for completion in last.outputs:
            streamed[completion.index] += completion.new_text
            latest[completion.index] = completion
        while True:
            print(streamed[live][printed:], end="", flush=True)
            printed = len(streamed[live])
            live_finished = live in latest and latest[live].finish_reason is not None
            if not live_finished or live + 1 not in latest:
                break
            print()
            print(completion_footer(latest[live], labelled=True))
            live, printed = live + 1, 0
            print(prompt, end="", flush=True)
    print()
    if params.n > 1:
        print(completion_footer(latest[live], labelled=True))
    return last
