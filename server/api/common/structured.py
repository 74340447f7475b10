"""Structured outputs: what a request asks the text to be — OpenAI's `response_format` (`json_schema`,
`json_object`), vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` — as one grammar the engine enforces
(engine/constraint.py). One constraint per request (400 for two); an invalid or unsupported one is a 400 that
names it, never a silent unconstrained answer."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ...engine import SamplingParams
from .dependencies import get_engine
from .errors import APIError
from .tools import ToolSpec, close_objects

MAX_CHOICES = 256


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | StrictBool = Field({}, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (one of its fields)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: StrictBool | None = None


class StructuredFields(BaseModel):
    """The request fields that ask for structure (part of the completion and chat request models)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = None

    def constraint(self) -> tuple[str, str, Any] | None:
        """(field, kind, value) of the one constraint asked for; None: free text."""
        asked: list[tuple[str, str, Any]] = []
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                asked.append(("response_format", "json_object", None))
            elif self.response_format.json_schema is None:
                raise APIError(400, "response_format json_schema needs its `json_schema`", "response_format")
            else:
                asked.append(("response_format", "json_schema", self.response_format.json_schema.schema_))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            for kind, value in (("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                                ("grammar", so.grammar)):
                if value is not None:
                    asked.append(("structured_outputs", kind, value))
            if so.json_object:
                asked.append(("structured_outputs", "json_object", None))
        for field, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                asked.append((field, kind, getattr(self, field)))
        if len(asked) > 1:
            raise APIError(400, f"one structured-output constraint per request, got {len(asked)}: "
                           + ", ".join(f"{field} ({kind})" for field, kind, _ in asked), asked[1][0])
        return asked[0] if asked else None


def grammar_asked(body: StructuredFields, tools: ToolSpec | None = None) -> tuple[str, str, Any] | None:
    """What the request's output must match, as the engine's grammar runtime compiles it: (the field asking,
    kind, value) — a JSON schema parsed and its objects closed (tools.close_objects), tool calls as their
    grammar — or None for free text."""
    asked = body.constraint()
    if asked is None and tools is None:
        return None
    field, kind, value = asked or ("tools", "grammar", None)
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise APIError(400, f"{field}: the JSON schema is not valid JSON", field) from None
    if kind == "json_schema":
        value = close_objects(value)  # an unstated additionalProperties is false
    if tools is not None:
        if asked is not None and kind not in ("json_schema", "json_object"):
            raise APIError(400, f"{field}: beside tools only a JSON schema or JSON object can shape the answer",
                           field)
        text_schema = None if asked is None else ({"type": "object"} if kind == "json_object" else value)
        if isinstance(text_schema, bool) or (text_schema is not None and not isinstance(text_schema, dict)):
            raise APIError(400, f"{field}: a JSON schema is an object", field)
        field, kind, value = "tools", "grammar", tools.grammar(text_schema)
    return field, kind, value


async def with_grammar(request: Request, body: StructuredFields, params: SamplingParams,
                       tools: ToolSpec | None = None) -> SamplingParams:
    """`params` with the request's grammar (compiled, or from the cache), or as they are. With tool calls allowed
    (`tools`) the grammar is theirs; a JSON constraint beside them shapes the plain-text answer. Compiling runs off
    the event loop (the first one also builds the tokenizer's view: a pass over the vocabulary)."""
    asked = grammar_asked(body, tools)
    if asked is None:
        return params
    field, kind, value = asked
    try:
        engine = get_engine(request)
        grammar = await asyncio.to_thread(lambda: engine.grammars.compile(kind, value))
    except ValueError as error:
        raise APIError(400, f"{field}: {kind} cannot be enforced: {error}", field, code="invalid_grammar") from None
    return dataclasses.replace(params, grammar=grammar)
