"""The ``/v1/images/edits`` multipart form: reading it (files only where the form takes files), and the OpenAPI
description of the route's two bodies, the form and OpenAI's JSON (the route reads its body itself, so FastAPI cannot
infer one)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.protocol import ImageEditJSONBody, ImageEditRequest
from vllm_omni.sampling_params import MAX_INPUT_IMAGES

FILE_FIELDS = ("image", "image[]", "mask")
"""The edit form's file fields (`form_files`)."""

IGNORED_FILE_FIELDS = ("markup",)
"""OpenAI's file fields that have no effect here: accepted, reported as ignored, never read."""


async def read_edit_form(raw_request: Request) -> FormData:
    """The edit's form, with files only where the form takes files. An empty body is an empty form, so that its
    refusal names the missing fields as any other form's does."""
    media_type = raw_request.headers.get("content-type", "").lower()
    if not await raw_request.body():
        return FormData()
    if not media_type.startswith(("multipart/form-data", "application/x-www-form")):
        raise APIError(400, "send the edit as multipart/form-data (image files and fields)", code="invalid_form")
    try:
        form = await raw_request.form(max_files=MAX_INPUT_IMAGES + 1, max_fields=64)
    except StarletteHTTPException as exc:  # a malformed body, or too many files or fields
        raise APIError(400, f"The form could not be read: {exc.detail}", code="invalid_form") from None
    for name, value in form.multi_items():
        if isinstance(value, UploadFile) and name not in FILE_FIELDS + IGNORED_FILE_FIELDS:
            known = name in ImageEditRequest.model_fields
            raise APIError(
                400,
                f"{name} must be a text field, not a file" if known else f"Unrecognized file field: {name}",
                param=name,
                code="invalid_value" if known else "unknown_parameter",
            )
    return form


def edit_request_body() -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of ``/v1/images/edits``: the multipart form (files) and OpenAI's JSON body (images
    by ``image_url``, `ImageEditJSONBody`)."""
    schema = ImageEditRequest.model_json_schema()
    files = {"type": "array", "items": {"type": "string", "format": "binary"}, "maxItems": MAX_INPUT_IMAGES}
    properties = schema["properties"] | {
        "image": {"type": "string", "format": "binary"},
        "image[]": files,
        "mask": {"type": "string", "format": "binary"},
        "markup": {"type": "string", "format": "binary", "description": schema["properties"]["markup"]["description"]},
        # A form field is text: the adapters arrive as JSON.
        "lora": {"type": "string", "description": 'LoRA adapters as JSON: {"name": ..., "scale": ...} or a list'},
    }
    form = {"type": "object", "properties": properties, "required": ["prompt"]}
    content = {"multipart/form-data": {"schema": form}, "application/json": {"schema": _inlined(ImageEditJSONBody)}}
    return {"required": True, "content": content}


def _inlined(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with each of its ``$defs`` in place of its references: a body given in a route's
    ``openapi_extra`` adds nothing to the document's components, and ``#/$defs/...`` would resolve against the
    document's root."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, list):
            return [resolve(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:  # its siblings (a field's description) over the definition's own
            named = definitions[node["$ref"].rsplit("/", 1)[1]]
            return resolve(named | {key: value for key, value in node.items() if key != "$ref"})
        return {key: resolve(value) for key, value in node.items()}

    return resolve(schema)
