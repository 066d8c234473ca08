"""The Images API's output files: each image in its requested format (``b64_json``, ``url`` and ``file``), and the
``response_format: file`` answer (the image, or a zip of several), and the ``Content-Disposition`` of a download
(`attachment`)."""

from __future__ import annotations

import asyncio
import base64
import io
import urllib.parse
import zipfile
from typing import Any, Literal, overload

from fastapi.responses import Response

from vllm_omni.entrypoints.openai.protocol import ImageGenerationRequest

MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(image, output_format: str, compression: int | None, b64: bool) -> bytes | str:
    """One image in its file format (as base64 text for ``b64_json``); runs in a worker thread."""
    buffer = io.BytesIO()
    if output_format == "png":
        image.save(buffer, format="PNG")
    else:
        quality = 100 if compression is None else compression
        image.convert("RGB").save(buffer, format=output_format.upper(), quality=quality)
    return base64.b64encode(buffer.getbuffer()).decode("ascii") if b64 else buffer.getvalue()


@overload
async def encode_images(images: list, body: ImageGenerationRequest, b64: Literal[True]) -> list[str]: ...
@overload
async def encode_images(images: list, body: ImageGenerationRequest, b64: Literal[False]) -> list[bytes]: ...
async def encode_images(images: list, body: ImageGenerationRequest, b64: bool) -> list[Any]:
    """The images in the request's file format, off the event loop: one worker thread per image (Pillow's encoders
    release the GIL)."""
    loop = asyncio.get_running_loop()
    return await asyncio.gather(
        *(
            loop.run_in_executor(None, encode_image, image, body.output_format, body.output_compression, b64)
            for image in images
        )
    )


def attachment(filename: str) -> dict[str, str]:
    """The ``Content-Disposition`` header of a download saved as ``filename`` (RFC 6266): ``attachment;
    filename="..."``, the name a quoted-string (its ``\\`` and ``"`` escaped), and for a name beyond ASCII also
    ``filename*`` in UTF-8 (RFC 5987), with an ASCII fallback."""
    ascii_name = filename.encode("ascii", "replace").decode("ascii").replace("\\", "\\\\").replace('"', '\\"')
    value = f'attachment; filename="{ascii_name}"'
    if not filename.isascii():
        value += f"; filename*=UTF-8''{urllib.parse.quote(filename, safe='')}"
    return {"Content-Disposition": value}


def files_response(files: list[bytes], output_format: str, name: str) -> Response:
    """``response_format: file``: the image itself, or a zip of ``image_0.png``, ``image_1.png``, ... for several,
    as an attachment named ``<name>.<png|jpeg|webp|zip>`` (``name``: the request's id)."""
    if len(files) == 1:
        return Response(files[0], media_type=MEDIA_TYPES[output_format], headers=attachment(f"{name}.{output_format}"))
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zipped:  # the images are compressed already
        for i, data in enumerate(files):
            zipped.writestr(f"image_{i}.{output_format}", data)
    return Response(archive.getvalue(), media_type="application/zip", headers=attachment(f"{name}.zip"))
