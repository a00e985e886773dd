"""Grammar-constrained decoding: ``SamplingParams.json_schema`` / ``json_object`` / ``structural_tag`` through xgrammar.

The engine keeps one ``xgrammar.GrammarMatcher`` per constrained sequence. Before a step samples, each
constrained row's matcher fills a packed bitmask of the tokens that may come next (bit ``t % 32`` of word
``t // 32``); the sampler sets every other logit of that row to -inf on the device, so constrained and
unconstrained rows share one batch. After the step each matcher accepts its row's token, and the sequence
stops once its matcher terminates: the JSON is complete and one of the request's stop tokens was chosen.

The output is compact JSON (``", "`` and ``": "`` between items, no other whitespace): a model cannot
spend its ``max_tokens`` on whitespace, and the text is what ``json.dumps`` would write.

    grammars = StructuredOutput(tokenizer, vocab_size=logits_width)
    matcher = new_matcher(grammars.compile(SamplingParams(json_object=True)), stop_token_ids={eos})
    row_bitmask = next_token_bitmask(matcher, logits_width)  # SamplingRow.token_bitmask
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Protocol

import torch

from autodeploy.errors import InvalidRequestError

_INSTALL = "structured output (json_schema / json_object / structural_tag, tool calls) needs xgrammar: pip install 'autodeploy[serve]'"
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "; the rest is the message.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
# json_object: any JSON object. Not strict, or xgrammar would allow only {} (no properties listed).
_ANY_OBJECT = '{"type": "object"}'


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError(_INSTALL) from None
    return xgrammar


def _compiler_message(error: Exception) -> str:
    return _CPP_PREFIX.sub("", " ".join(str(error).split()))


# Keywords whose values are data (a "$ref" in them is a value, not a reference), and those that map names to
# schemas (a property may be called "const" or "$ref").
_DATA_KEYWORDS = ("const", "enum", "default", "examples")
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _outside_refs(schema) -> Iterator[str]:
    """The ``$ref`` / ``$dynamicRef`` values of a schema (or a structural tag holding schemas) that do not point
    into the document itself (``#…``): URLs, files, other documents."""
    if isinstance(schema, list):
        for item in schema:
            yield from _outside_refs(item)
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in ("$ref", "$dynamicRef") and isinstance(value, str):
            if not value.startswith("#"):
                yield value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            for named in value.values():
                yield from _outside_refs(named)
        elif key not in _DATA_KEYWORDS:
            yield from _outside_refs(value)


def _check_refs_inside(what: str, schema: dict | str) -> None:
    """Refuse a schema that refers outside itself: nothing is ever fetched, and xgrammar, finding no such
    definition, would constrain the output to something else than asked."""
    try:
        ref = next(_outside_refs(json.loads(schema) if isinstance(schema, str) else schema), None)
    except ValueError:  # not JSON: the compiler says so
        return
    if ref is not None:
        raise InvalidRequestError(f"{what} refers outside itself: $ref {ref!r} (only refs into the schema, such as "
                                  '"#/$defs/name", are followed, and nothing is fetched); put the referenced schema under $defs')


def check_json_schema(schema: dict | str) -> None:
    """Raise ``InvalidRequestError`` with xgrammar's message unless ``schema`` converts to a grammar, or naming
    a ``$ref`` that points outside the schema.

    >>> check_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    >>> check_json_schema({"type": "nonsense"})
    Traceback (most recent call last):
    ...
    autodeploy.errors.InvalidRequestError: json_schema is not a JSON Schema that can be enforced: Unsupported type "nonsense"
    """
    _check_refs_inside("json_schema", schema)
    try:
        _xgrammar().Grammar.from_json_schema(schema, any_whitespace=False)
    except InvalidRequestError:
        raise
    except Exception as error:
        raise InvalidRequestError(f"json_schema is not a JSON Schema that can be enforced: {_compiler_message(error)}") from None


def check_structural_tag(tag: dict | str) -> None:
    """Raise ``InvalidRequestError`` with xgrammar's message unless ``tag`` (xgrammar's structural tag
    format, as a dict or its JSON text) converts to a grammar."""
    _check_refs_inside("structural_tag", tag)
    try:
        _xgrammar().Grammar.from_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
    except InvalidRequestError:
        raise
    except Exception as error:
        raise InvalidRequestError(f"structural_tag cannot be enforced: {_compiler_message(error)}") from None


class GrammarRequest(Protocol):
    """What a request's grammar is read from: ``SamplingParams``'s fields, which import this module to
    check them (so this module names the fields instead of importing ``SamplingParams`` back)."""

    json_schema: dict | str | None
    json_object: bool
    structural_tag: dict | str | None


class StructuredOutput:
    """One engine's grammar compiler, over the tokenizer's vocabulary padded to the logits' width.

    Compiling a schema walks the whole vocabulary once; xgrammar's compiler caches what it compiled by
    the schema's text, so a schema that many requests share is compiled once.
    """

    def __init__(self, tokenizer, vocab_size: int):
        xgrammar = _xgrammar()
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info)  # thread-safe: front ends compile from their own threads

    def compile(self, params: GrammarRequest):
        """The compiled grammar of a validated request with ``json_schema``, ``json_object`` or ``structural_tag``."""
        if params.structural_tag is not None:
            tag = params.structural_tag
            tag = tag if isinstance(tag, str) else json.dumps(tag, sort_keys=True)
            try:
                return self._compiler.compile_structural_tag(tag)
            except Exception as error:
                raise InvalidRequestError(f"structural_tag could not be compiled into a grammar: {_compiler_message(error)}") from None
        schema = params.json_schema if params.json_schema is not None else _ANY_OBJECT
        if isinstance(schema, dict):
            schema = json.dumps(schema, sort_keys=True)  # one cache entry however the keys were ordered
        try:
            return self._compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=params.json_schema is not None)
        except Exception as error:
            raise InvalidRequestError(f"json_schema could not be compiled into a grammar: {_compiler_message(error)}") from None


def new_matcher(compiled_grammar, stop_token_ids: set[int]):
    """A matcher at the start of the grammar, which ends on one of the request's stop tokens (or, with
    none, as soon as the JSON is complete)."""
    return _xgrammar().GrammarMatcher(
        compiled_grammar, override_stop_tokens=sorted(stop_token_ids) or None, terminate_without_stop_token=not stop_token_ids
    )


def next_token_bitmask(matcher, vocab_size: int) -> torch.Tensor:
    """``[ceil(vocab_size / 32)]`` int32 on the host: bit ``t % 32`` of word ``t // 32`` is set when token
    ``t`` may come next."""
    xgrammar = _xgrammar()
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]
