"""Structured captions: a caption decoded under a JSON schema (a job's or a request's `schema`), parsed and checked
against it.

Nothing is ever fetched for a schema: validators are built with a retriever that refuses every URI (`$ref` to
`http(s)://`, `file://` or any other document), so a schema can only refer within itself, and no error text
carries a referenced document back. Validation costs CPU on large schemas and values: callers on an event loop
run it in a thread.
"""

from __future__ import annotations

import json
import re
from typing import Any

SHOWN_CHARS = 200  # how much of a caption an error quotes


class SchemaRefused(ValueError):
    """A schema that can never be used (not a valid JSON Schema, refers outside itself, over a server limit): a job
    that carries one is dead-lettered at once, not retried."""


def _refuse(uri: str) -> Any:
    raise ValueError("nothing is fetched for a schema")


def caption_validator(schema: dict) -> Any:
    """A jsonschema-rs validator for `schema` that fetches nothing; SchemaRefused saying why it cannot be built."""
    import jsonschema_rs

    if not isinstance(schema, dict):
        raise SchemaRefused(f"a caption schema must be a JSON object (a JSON Schema), got {type(schema).__name__}")
    try:
        return jsonschema_rs.validator_for(schema, retriever=_refuse)
    except Exception as err:  # jsonschema_rs raises its own types for schemas it cannot use
        message = str(err).split("\n")[0]
        outside = re.match(r"Resource '(.*?)' is not present in a registry and retrieving it failed", message)
        if outside:
            raise SchemaRefused(f"the schema refers to {outside.group(1)[:SHOWN_CHARS]!r}, outside itself: references "
                                "are followed only within the schema (#/...), nothing is fetched") from None
        raise SchemaRefused(f"the schema is not a valid JSON Schema: {message[:SHOWN_CHARS]}") from None


def structured_caption(text: str, schema: dict) -> dict:
    """A structured caption parsed and checked against its schema; ValueError saying why not (SchemaRefused for a
    schema that can never be used)."""
    validator = caption_validator(schema)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"the caption is not valid JSON ({err}); was it cut at max_tokens? "
                         f"{text[:SHOWN_CHARS]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"the caption is JSON but not an object: {text[:SHOWN_CHARS]!r}")
    errors = [error.message[:SHOWN_CHARS] for error in validator.iter_errors(value)]
    if errors:
        raise ValueError(f"the caption does not match the schema: {'; '.join(errors[:3])}")
    return value
