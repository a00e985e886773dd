"""``LLM.chat``: one chat turn, or the tool-calling loop that agent frameworks run, in-process.

Each round renders the conversation through the chat template (with the tools), generates the
assistant's turn — tool calls under their grammar (``frontend/tool_calls.py``) — and, when the model
called tools of a ``ToolRegistry`` (``autodeploy/frontend/tools.py``), runs them and appends their results as
``tool`` messages; it ends when a turn calls nothing, or after ``max_rounds`` turns. ``tool_choice``
applies to the first round; later rounds are ``"auto"``, or a model told to call a tool every turn
would never answer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from autodeploy.errors import InvalidRequestError
from autodeploy.frontend.chat_template import render_chat, tool_call_format
from autodeploy.runtime.outputs import RequestOutput
from autodeploy.frontend.reasoning import opens_thinking, split_reasoning
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.frontend.tool_calls import CutOffToolCall, ToolCall, ToolChoice, ToolSpec, parse_tool_calls, parse_tool_choice, tool_call_grammar, tool_specs


@dataclass
class ChatResult:
    """``content``: the last assistant turn's text (None when it only called tools). ``tool_calls``: the
    calls of that turn that were not run (tools given as schemas, or ``max_rounds`` reached).
    ``messages``: the whole conversation, the given messages first, ready for the next user turn.
    ``trace``: every call that ran, in order (a ``ToolResult`` each: the call, its output, its error).
    ``finish_reason``: the last turn's ("stop", "length", "tool_calls") or ``"max_rounds"``.
    ``outputs``: each round's ``RequestOutput``. ``reasoning``: the last turn's think block (with
    ``reasoning=True``; None when it had none)."""

    content: str | None
    tool_calls: list[ToolCall]
    messages: list[dict]
    trace: list = field(default_factory=list)
    finish_reason: str | None = None
    outputs: list[RequestOutput] = field(default_factory=list)
    reasoning: str | None = None


def run_chat(llm, messages: list[dict], params: SamplingParams | None, tools, tool_choice, max_rounds: int,
             chat_template: str | None, parallel_tool_calls: bool, call_format: str = "auto", reasoning: bool = False) -> ChatResult:
    """The loop behind ``LLM.chat`` (see there)."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise InvalidRequestError('chat() needs a non-empty list of messages like {"role": "user", "content": "…"}')
    if not isinstance(max_rounds, int) or max_rounds < 1:
        raise InvalidRequestError(f"max_rounds must be an integer ≥ 1, got {max_rounds!r}")
    params = params if params is not None else SamplingParams(max_tokens=256, temperature=0)
    if params.n != 1 or params.beam_width != 1:
        raise InvalidRequestError("chat() continues one conversation: use n=1 and beam_width=1")
    registry = tools if hasattr(tools, "call") and hasattr(tools, "specs") else None
    specs = (registry.specs() if registry is not None else tool_specs(tools)) if tools else None
    choice = parse_tool_choice(tool_choice, specs, parallel_tool_calls, tool_call_format(llm.tokenizer, chat_template, call_format))
    conversation = [dict(m) for m in messages]
    result = ChatResult(None, [], conversation)
    for _ in range(max_rounds):
        output = _assistant_turn(llm, conversation, params, specs, choice, chat_template)
        completion = output.outputs[0]
        thought, answer = None, completion.text
        if reasoning:
            thought, answer = split_reasoning(answer, llm.tokenizer is not None and opens_thinking(llm.tokenizer.decode(output.prompt_token_ids[-8:])))
        content, calls = parse_tool_calls(answer or "", specs) if specs and choice.mode != "none" else (answer, [])
        turn = {"role": "assistant", "content": content}
        if thought is not None:
            turn["reasoning_content"] = thought
        if calls:
            turn["tool_calls"] = [c.to_openai() for c in calls]
        conversation.append(turn)
        result.outputs.append(output)
        result.content, result.tool_calls, result.reasoning = content, calls, thought
        result.finish_reason = "tool_calls" if calls and completion.finish_reason == "stop" else completion.finish_reason
        if not calls or registry is None or any(isinstance(call, CutOffToolCall) for call in calls):
            return result  # (a call cut off by max_tokens is reported, never run; finish_reason "length")
        for call in calls:
            ran = registry.call(call)
            result.trace.append(ran)
            conversation.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": ran.output})
        result.tool_calls = []
        choice = dataclasses.replace(choice, mode="auto", name=None)
    result.finish_reason = "max_rounds"
    return result


def _assistant_turn(llm, conversation: list[dict], params: SamplingParams, specs: list[ToolSpec] | None, choice: ToolChoice,
                    chat_template: str | None) -> RequestOutput:
    """The turn's output (its prompt: token ids; with images, ``{"prompt": ids, "images": …}``)."""
    prompt = render_chat(llm.tokenizer, conversation, chat_template, specs, llm.image_token)
    grammar = tool_call_grammar(specs, choice) if specs else None
    turn_params = dataclasses.replace(params, structural_tag=grammar) if grammar is not None else params
    return llm.generate([prompt], turn_params)[0]
