"""Chat messages → prompt token ids, through the tokenizer's chat template (or ``--chat-template FILE``)."""

from __future__ import annotations

from autodeploy.errors import InvalidRequestError


def render_chat(tokenizer, messages: list[dict], chat_template: str | None) -> list[int]:
    """Token ids of ``messages`` followed by the assistant's turn. The rendered text already holds whatever
    special tokens the template writes (BOS included), so it is tokenized without adding more."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer, so chat messages cannot be rendered; use /v1/completions with token ids")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; start the server with --chat-template FILE "
                                  "(a Jinja template) or use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # jinja2 errors, and raise_exception() in templates that check the roles' order
        raise InvalidRequestError(f"the chat template could not render these messages: {error}") from None
    return tokenizer(text, add_special_tokens=False).input_ids
