"""Fifty JSON schemas for structured outputs: nested objects, arrays, enums, numbers, strings with patterns,
optional fields (issue 32's suite: every output must parse and validate)."""

from __future__ import annotations

STRING, INTEGER, NUMBER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **extra}


SCHEMAS: list[dict] = [
    obj({"name": STRING}),
    obj({"age": INTEGER}),
    obj({"score": NUMBER}),
    obj({"ok": BOOLEAN}),
    obj({"name": STRING, "age": INTEGER}),
    obj({"name": STRING, "age": INTEGER, "ok": BOOLEAN}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"level": {"enum": [1, 2, 3]}}),
    obj({"mood": {"enum": ["happy", "sad"]}, "why": STRING}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"word": {"type": "string", "minLength": 2, "maxLength": 8}}),
    obj({"tags": {"type": "array", "items": STRING}}),
    obj({"tags": {"type": "array", "items": STRING, "maxItems": 3}}),
    obj({"nums": {"type": "array", "items": INTEGER, "minItems": 2}}),
    obj({"points": {"type": "array", "items": NUMBER, "minItems": 1, "maxItems": 4}}),
    obj({"flags": {"type": "array", "items": BOOLEAN}}),
    obj({"picks": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1}}),
    obj({"inner": obj({"x": INTEGER})}),
    obj({"inner": obj({"x": INTEGER, "y": INTEGER})}),
    obj({"a": obj({"b": obj({"c": STRING})})}),
    obj({"point": obj({"x": NUMBER, "y": NUMBER}), "label": STRING}),
    obj({"items": {"type": "array", "items": obj({"id": INTEGER, "name": STRING}), "maxItems": 2}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": INTEGER, "maxItems": 2}, "maxItems": 2}}),
    obj({"name": STRING, "nick": STRING}, required=["name"]),
    obj({"name": STRING, "age": INTEGER}, required=[]),
    obj({"title": STRING, "year": INTEGER, "rating": NUMBER}, required=["title"]),
    obj({"a": STRING, "b": STRING}, required=["a"], additionalProperties=False),
    obj({"x": INTEGER}, additionalProperties=False),
    obj({"count": {"type": "integer", "minimum": 0, "maximum": 9}}),
    obj({"temp": {"type": "number", "minimum": -50, "maximum": 50}}),
    obj({"year": {"type": "integer", "minimum": 1500, "maximum": 1700}}),
    obj({"value": {"anyOf": [STRING, INTEGER]}}),
    obj({"value": {"type": ["string", "null"]}}),
    obj({"note": {"type": "null"}}),
    obj({"kind": {"const": "play"}}),
    obj({"kind": {"const": "play"}, "acts": {"type": "integer", "minimum": 1, "maximum": 5}}),
    obj({"speaker": STRING, "line": STRING, "act": INTEGER, "scene": INTEGER}),
    obj({"cast": {"type": "array", "items": obj({"name": STRING, "role": {"enum": ["lead", "minor"]}}),
                  "minItems": 1, "maxItems": 3}}),
    obj({"meta": obj({"tags": {"type": "array", "items": STRING, "maxItems": 2}, "draft": BOOLEAN})}),
    obj({"email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"}}),
    obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    obj({"id": {"type": "string", "pattern": "^[a-f0-9]{8}$"}, "n": INTEGER}),
    obj({"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"list": {"type": "array", "items": obj({"k": STRING, "v": INTEGER}), "minItems": 1, "maxItems": 2}}),
    {"type": "array", "items": INTEGER, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": obj({"q": STRING}), "maxItems": 2},
    {"enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 0, "maximum": 100},
    {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
    obj({"ref": {"$ref": "#/$defs/person"}}, **{"$defs": {"person": obj({"name": STRING})}}),
]
