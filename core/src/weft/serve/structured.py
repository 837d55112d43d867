"""A request's output constraint from the API's fields: ``response_format``, vLLM's ``structured_outputs``,
the Responses API's ``text.format``.

Each function returns a :class:`~weft.contracts.structured_output.StructuredOutputsParams`
(or None) and the request field it came from, and raises ValueError naming the field for
a value Weft refuses (the server answers 400). Whether the backend can compile the
constraint is checked later, by the backend's own ``validate``
(:meth:`weft.engine.api.frontend.Frontend.core_request`); :func:`name_field` rewrites its
message to name the field the client used.
"""

from __future__ import annotations

from typing import Any

from weft.contracts.structured_output import StructuredOutputsParams
from weft.serve import protocol as p
from weft.serve.body import check_json_text

Constraint = tuple[StructuredOutputsParams | None, str]


def from_sampling_fields(body: p.SamplingFields) -> Constraint:
    """Chat and completions: ``response_format`` or ``structured_outputs`` (not both)."""
    response_format = _from_response_format(body.response_format)
    vllm = _from_vllm(body.structured_outputs)
    if response_format is not None and vllm is not None:
        raise ValueError("response_format and structured_outputs both constrain the output; give one of them")
    if response_format is not None:
        return response_format, "response_format.json_schema.schema"
    return vllm, "structured_outputs"


def from_text_format(text: p.ResponseText | None) -> Constraint:
    """The Responses API's ``text.format``: text, json_object or json_schema."""
    if text is None or text.format is None:
        return None, "text.format"
    kind = text.format.type
    if kind == "text":
        return None, "text.format"
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), "text.format"
    if kind == "json_schema":
        if text.format.schema is None:
            raise ValueError("text.format.schema: a json_schema format needs its schema")
        return _schema(text.format.schema, "text.format.schema"), "text.format.schema"
    raise ValueError(f"text.format.type = {kind!r}: expected 'text', 'json_object' or 'json_schema'")


def name_field(message: str, field: str) -> str:
    """A backend's message about ``structured_outputs.json`` etc., naming the field the client used instead."""
    if field == "structured_outputs":
        return message
    for name in ("json_object", "json"):
        message = message.replace(f"structured_outputs.{name}", field)
    return message


def _from_response_format(response_format: p.ResponseFormat | None) -> StructuredOutputsParams | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.type == "json_schema":
        json_schema = response_format.json_schema
        if json_schema is None or json_schema.schema is None:
            raise ValueError("response_format.json_schema.schema: a json_schema response format needs its schema")
        return _schema(json_schema.schema, "response_format.json_schema.schema")
    raise ValueError(
        f"response_format.type = {response_format.type!r}: expected 'text', 'json_object' or 'json_schema'"
    )


def _from_vllm(fields: p.StructuredOutputsRequest | None) -> StructuredOutputsParams | None:
    if fields is None:
        return None
    for name in ("structural_tag", "whitespace_pattern"):
        if getattr(fields, name) is not None:
            raise ValueError(f"structured_outputs.{name}: not supported; use json, regex, choice or grammar")
    given: dict[str, Any] = {
        name: getattr(fields, name)
        for name in ("json", "regex", "choice", "grammar")
        if getattr(fields, name) is not None
    }
    if isinstance(fields.json, str):
        check_json_text(fields.json, "structured_outputs.json")
    if fields.json_object:
        given["json_object"] = True
    if not given:
        return None
    return StructuredOutputsParams(**given, any_whitespace=not fields.disable_any_whitespace)


def _schema(schema: dict[str, Any], field: str) -> StructuredOutputsParams:
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: a JSON schema is an object")
    return StructuredOutputsParams(json=schema)
