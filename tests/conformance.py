"""linserve's answers against OpenAI's published API schema (tests/fixtures/openai/schemas.json, vendored by
tests/fixtures/openai/vendor.py with its source commit): `check(schema, body)` validates a body or one SSE
chunk with jsonschema (Draft 2020-12) and raises with every error found.

Where OpenAI's real behaviour and its spec disagree, linserve follows the behaviour; the exceptions, each with
its reason, are the schema patches in EXCEPTIONS — the one place they are listed."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

VENDORED = Path(__file__).with_name("fixtures") / "openai" / "schemas.json"
NUMBER_OR_NULL = {"anyOf": [{"type": "number"}, {"type": "null"}]}


def _openapi_nullable(schemas: dict) -> None:
    """The spec is OpenAPI 3.1 but still writes some nullable fields in 3.0's `nullable: true` (the chat stream's
    logprobs); JSON Schema ignores that keyword, so it is honoured here as null-or-the-schema."""

    def walk(node):
        if isinstance(node, dict):
            for key, value in list(node.items()):
                node[key] = walk(value)
            if node.pop("nullable", False):
                return {"anyOf": [node, {"type": "null"}]}
        elif isinstance(node, list):
            return [walk(value) for value in node]
        return node

    for name in list(schemas):
        schemas[name] = walk(schemas[name])


def _choice_finish_reason_nullable(schemas: dict) -> None:
    """Legacy completion streams (OpenAI's own) carry `finish_reason: null` until a choice ends; the spec shares
    the non-streamed object, whose enum has no null (the chat chunk's says `nullable`)."""
    reason = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]["finish_reason"]
    reason["enum"] = [*reason["enum"], None]
    reason["type"] = ["string", "null"]


def _echo_first_logprob_null(schemas: dict) -> None:
    """With echo, the prompt's first token has no logprob (nothing predicts it): OpenAI sends null there."""
    logprobs = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]["logprobs"]
    shape = logprobs["anyOf"][0]["properties"]
    shape["token_logprobs"]["items"] = NUMBER_OR_NULL
    shape["top_logprobs"]["items"] = {"anyOf": [shape["top_logprobs"]["items"], {"type": "null"}]}


EXCEPTIONS = (_openapi_nullable, _choice_finish_reason_nullable, _echo_first_logprob_null)


@cache
def _registry() -> tuple[Registry, dict]:
    vendored = json.loads(VENDORED.read_text())
    schemas = copy.deepcopy(vendored["schemas"])
    for patch in EXCEPTIONS:
        patch(schemas)
    document = {"components": {"schemas": schemas}}
    resource = Resource(contents=document, specification=DRAFT202012)
    return Registry().with_resource("openai", resource), schemas


def check(schema: str, body: dict) -> None:
    """Raise AssertionError naming every place `body` breaks OpenAI's `schema` (a components/schemas name)."""
    registry, schemas = _registry()
    assert schema in schemas, f"{schema} is not vendored (tests/fixtures/openai/vendor.py ROOTS)"
    validator = Draft202012Validator({"$ref": f"openai#/components/schemas/{schema}"}, registry=registry)
    errors = sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
    assert not errors, f"{schema}: " + "; ".join(
        f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:200]}" for e in errors[:8])
