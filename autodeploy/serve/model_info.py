"""Routes that describe the served model: ``GET /v1/models/{id}`` (the openai client's ``models.retrieve``) and
``GET /tokenizer_info`` (vLLM's, which lm-eval's ``local-completions`` reads to use the server's tokenizer
instead of downloading one from the hub).

    add_model_info_routes(app, server, list_models)  # in build_app, beside GET /v1/models
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Depends, FastAPI

from autodeploy.serve.openai_errors import APIError
from autodeploy.serve.route_server import RouteServer

# Special tokens lm-eval's remote tokenizer reads by name; the key is there (None) when the tokenizer has none.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def add_model_info_routes(app: FastAPI, server: RouteServer, list_models: Callable[[], Awaitable[dict]]) -> None:
    """Register the two routes on ``app``; ``server`` is app.py's ``_Server`` (a ``RouteServer``) and ``list_models``
    the handler of ``GET /v1/models``, whose cards ``models.retrieve`` returns one by one."""
    authorized = [Depends(server.check_api_key)]

    @app.get("/v1/models/{model_id:path}", dependencies=authorized)  # :path: hub ids hold a slash
    async def retrieve_model(model_id: str) -> dict:
        cards = (await list_models())["data"]
        for card in cards:
            if card["id"] == model_id:
                return card
        raise APIError(404, f"the model {model_id!r} does not exist here; this server serves {', '.join(repr(c['id']) for c in cards)}",
                       param="model", code="model_not_found")

    @app.get("/tokenizer_info", dependencies=authorized)
    async def tokenizer_info() -> dict:
        tokenizer = server.llm.tokenizer
        if tokenizer is None:
            raise APIError(404, "this model has no tokenizer files, so there is no tokenizer to describe; "
                                "send token ids to /v1/completions", code="tokenizer_not_found")
        return _tokenizer_config(tokenizer, server.options.chat_template, server.options.served_model_name, server.engine.max_seq_len)


def _tokenizer_config(tokenizer, chat_template: str | None, model: str, max_seq_len: int) -> dict:
    """vLLM's answer: the tokenizer's ``tokenizer_config.json`` values (special tokens as their text), its class
    and the chat template the server renders with. Paths on the server's disk are left out; ``name_or_path`` is
    the served model's id and ``model_max_length`` the engine's context, the limit requests actually meet."""
    config = {key: _as_json(value) for key, value in tokenizer.init_kwargs.items() if not key.endswith("_file")}
    config |= {name: getattr(tokenizer, name, None) for name in _SPECIAL_TOKENS}
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    config |= {"tokenizer_class": type(tokenizer).__name__, "name_or_path": model, "model_max_length": max_seq_len,
               "chat_template": template}
    return config


def _as_json(value):
    """``AddedToken``s (and dicts and lists of them) as their text, as vLLM writes them."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(key): _as_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_json(item) for item in value]
    return value
