"""Input images given by reference instead of as a file: OpenAI's ``{"image_url": ...}`` objects in a JSON body
(``/v1/images/edits``: ``images`` and ``mask``; ``/v1/videos``: ``input_reference``) and upstream vllm-omni's
``image_reference`` and ``video_reference``: hostile until checked, as uploads are.

A reference is one of:

- a data URL (``data:image/png;base64,...``): always taken;
- an ``http(s)`` URL, fetched with vLLM's rules: with ``--allowed-media-domains`` only from those hosts (compared
  exactly, as vLLM compares them); without it from any host whose addresses are all global. A host that resolves to a
  private, loopback, link-local or otherwise non-global address is refused unless it is listed in
  ``--allowed-media-domains`` (no server-side request forgery). The host is resolved once and the connection made
  to the address that passed the check (its name kept for ``Host`` and TLS), so DNS rebinding cannot switch it;
  each redirect is a new URL checked the same way (`MAX_REDIRECTS` of them, none with
  ``VLLM_MEDIA_URL_ALLOW_REDIRECTS=0``). A fetch takes at most ``VLLM_IMAGE_FETCH_TIMEOUT`` seconds (vLLM's, 5 by
  default) and ``--max-input-image-bytes``;
- a ``file://`` URL of a file under ``--allowed-local-media-path`` (vLLM's flag; none without it).

The bytes then pass the upload checks (`uploads.decode_image`: size, format, header pixels before decoding). Every
refusal and every failed fetch is a 400 naming the field, in OpenAI's error envelope.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

import httpx
from fastapi import Request
from PIL import Image

from vllm_omni.config.serving import ServingConfig
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.uploads import decode_image
from vllm_omni.sampling_params import MAX_INPUT_IMAGES

MAX_REDIRECTS = 5
"""Redirects a fetch follows, each checked as the first URL was."""

DEFAULT_FETCH_TIMEOUT_S = 5.0
"""vLLM's default ``VLLM_IMAGE_FETCH_TIMEOUT``: the seconds one fetch may take, from resolving its host to its last
byte (redirects included)."""

VIDEO_REFERENCE_REFUSAL = (
    "video_reference is not supported: no pipeline family this server serves takes a video as input (its "
    "image-to-video models take an image: input_reference or image_reference)"
)

REFERENCE_FIELDS = ("input_reference", "image_reference", "video_reference")
"""A video request's reference fields: at most one of them (or an ``input_reference`` file) per request."""


@dataclass(frozen=True)
class MediaReference:
    """One input image given by reference: ``param``, the field it came in, as its errors name it; ``label``, where
    in that field (``images[1]``); ``url``, a data, http(s) or file URL."""

    param: str
    label: str
    url: str


@dataclass(frozen=True)
class FetchLimits:
    """What a fetch may do: the operator's flags (`from_serving`), or a test's."""

    allowed_domains: tuple[str, ...] = ()
    """``--allowed-media-domains``: empty, any host with only global addresses."""
    local_path: Path | None = None
    """``--allowed-local-media-path``, resolved: ``None``, no ``file://`` URL."""
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    allow_redirects: bool = True

    @classmethod
    def from_serving(cls, serving: ServingConfig) -> FetchLimits:
        path = serving.allowed_local_media_path
        return cls(
            allowed_domains=tuple(serving.allowed_media_domains or ()),
            local_path=Path(path).resolve() if path else None,
            timeout_s=float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", DEFAULT_FETCH_TIMEOUT_S)),
            allow_redirects=bool(int(os.environ.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1"))),
        )


# --- The request shapes --------------------------------------------------------------------------------------------


def is_json(raw_request: Request) -> bool:
    """Whether the request's body is JSON (an edit by ``image_url``, not the multipart form)."""
    return raw_request.headers.get("content-type", "").lower().startswith("application/json")


def reference_url(value: Any, label: str, param: str, *, string: bool = False) -> MediaReference:
    """``{"image_url": URL}`` (OpenAI's shape; a plain URL string too where ``string``), as a `MediaReference`;
    ``{"file_id": ...}`` is refused: this server has no Files API."""
    if string and isinstance(value, str):
        url = value
    elif isinstance(value, dict) and "file_id" in value:
        raise APIError(
            400,
            f"{label}.file_id is not supported: this server has no Files API; give image_url (a data URL or an "
            "http(s) URL) instead",
            param=param,
            code="unsupported_value",
        )
    elif isinstance(value, dict) and set(value) == {"image_url"} and isinstance(value["image_url"], str):
        url = value["image_url"]
    else:
        shape = '{"image_url": URL} or a URL string' if string else '{"image_url": URL}'
        raise APIError(400, f"{label} must be {shape}", param=param, code="invalid_value")
    if not url:
        raise APIError(400, f"{label}: the URL is empty", param=param, code="invalid_value")
    return MediaReference(param, label, url)


def fold_form_references(data: dict[str, Any]) -> dict[str, Any]:
    """A form's ``NAME[image_url]`` and ``NAME[file_id]`` fields (what the openai SDK sends for a reference object
    given in ``extra_body`` of a multipart call) as the JSON body's ``NAME: {"image_url": ...}``."""
    folded: dict[str, Any] = {}
    for key, value in data.items():
        name, bracket, rest = key.partition("[")
        if bracket and rest in ("image_url]", "file_id]") and name in REFERENCE_FIELDS:
            folded[name] = {rest[:-1]: value}
        else:
            folded[key] = value
    return folded


def video_reference(data: dict[str, Any], uploaded: bool) -> MediaReference | None:
    """Take the reference fields out of a video request's body ``data`` (the rest is the request): the one image
    reference it gives, or ``None``; ``uploaded``: it has an ``input_reference`` file too. Two references are a 400
    naming both; ``video_reference`` is refused (no served family takes a video)."""
    given = [name for name in REFERENCE_FIELDS if data.get(name) is not None]
    values = {name: data.pop(name) for name in REFERENCE_FIELDS if name in data}
    if uploaded and "input_reference" in given:  # a form with a file and a text field of the same name
        raise APIError(400, "input_reference is given twice: as a file and as a field", param="input_reference")
    if uploaded:
        given.insert(0, "input_reference")
    if len(given) > 1:
        raise APIError(
            400,
            f"{given[0]} and {given[1]} are both given: a video takes one reference image",
            param=given[1],
            code="invalid_value",
        )
    if not given or given == ["input_reference"] and uploaded:
        return None
    name = given[0]
    if name == "video_reference":
        raise APIError(400, VIDEO_REFERENCE_REFUSAL, param=name, code="unsupported_value")
    return reference_url(values[name], name, name, string=name == "image_reference")


@dataclass(frozen=True)
class EditReferences:
    """A JSON edit's ``images`` and ``mask``."""

    images: list[MediaReference]
    mask: MediaReference | None


def edit_references(data: dict[str, Any]) -> EditReferences:
    """Take ``images`` and ``mask`` out of a JSON edit body ``data`` (the rest is the request's fields)."""
    images, mask = data.pop("images", None), data.pop("mask", None)
    for name in ("image", "image[]"):
        if name in data:
            raise APIError(
                400,
                f'{name} is a file of the multipart form; a JSON body gives images: [{{"image_url": URL}}, ...]',
                param=name,
                code="invalid_value",
            )
    if images is None:
        raise APIError(
            400, 'images is required: [{"image_url": URL}, ...]', param="images", code="missing_required_parameter"
        )
    if not isinstance(images, list) or not images:
        raise APIError(400, 'images must be a list of {"image_url": URL}, one or more', param="images")
    if len(images) > MAX_INPUT_IMAGES:
        raise APIError(400, f"at most {MAX_INPUT_IMAGES} images", param="images", code="invalid_value")
    return EditReferences(
        [reference_url(value, f"images[{i}]", "images") for i, value in enumerate(images)],
        None if mask is None else reference_url(mask, "mask", "mask"),
    )


async def read_json_object(raw_request: Request) -> dict[str, Any]:
    """The request's JSON body, which must be an object."""
    try:
        data = await raw_request.json()
    except ValueError:
        raise APIError(400, "The request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_request")
    return data


# --- Reading a reference -------------------------------------------------------------------------------------------


async def read_references(
    references: list[MediaReference], serving: ServingConfig, limits: FetchLimits | None = None
) -> list[Image.Image]:
    """The checked, decoded images of ``references``, one after the other (each fetch has its own time limit)."""
    limits = limits or FetchLimits.from_serving(serving)
    images = []
    for reference in references:
        data = await reference_bytes(reference, serving.max_input_image_bytes, limits)
        images.append(await asyncio.to_thread(decode_image, data, reference.param, serving))
    return images


async def reference_bytes(reference: MediaReference, max_bytes: int, limits: FetchLimits) -> bytes:
    """The bytes ``reference`` names, at most ``max_bytes`` of them (see the module docstring)."""
    url = reference.url
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url_bytes(reference, max_bytes)
    if scheme in ("http", "https"):
        try:
            async with asyncio.timeout(limits.timeout_s):
                return await _fetch(reference, max_bytes, limits)
        except TimeoutError:
            raise _failed(
                reference, f"no answer within {limits.timeout_s:g} s (VLLM_IMAGE_FETCH_TIMEOUT)", "image_url_timeout"
            ) from None
    if scheme == "file":
        return await asyncio.to_thread(_file_bytes, reference, max_bytes, limits)
    raise APIError(
        400,
        f"{reference.label}: the URL must be a data URL (data:image/png;base64,...), an http(s) URL or a file:// URL",
        param=reference.param,
        code="invalid_image_url",
    )


def _data_url_bytes(reference: MediaReference, max_bytes: int) -> bytes:
    """RFC 2397's ``data:[<mediatype>][;base64],<data>``, base64 only (as vLLM takes them)."""
    spec, comma, payload = reference.url[5:].partition(",")
    if not comma or spec.rpartition(";")[2].lower() != "base64":
        raise APIError(
            400,
            f"{reference.label}: a data URL must be base64, as data:image/png;base64,...",
            param=reference.param,
            code="invalid_image_url",
        )
    if len(payload) // 4 * 3 > max_bytes + 3:  # refused before it is decoded
        raise _too_large(reference, max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(
            400, f"{reference.label}: the data URL is not valid base64", param=reference.param, code="invalid_image_url"
        ) from None
    if len(data) > max_bytes:
        raise _too_large(reference, max_bytes)
    return data


def _file_bytes(reference: MediaReference, max_bytes: int, limits: FetchLimits) -> bytes:
    """A ``file://`` URL's file: only under ``--allowed-local-media-path`` (as vLLM reads them)."""
    if limits.local_path is None:
        raise APIError(
            400,
            f"{reference.label}: file:// URLs are not allowed on this server (the operator allows a folder with "
            "--allowed-local-media-path)",
            param=reference.param,
            code="invalid_image_url",
        )
    parts = urlsplit(reference.url)
    path = Path(unquote(parts.netloc + parts.path)).resolve()
    if limits.local_path not in path.parents:
        raise APIError(
            400,
            f"{reference.label}: the file must be under --allowed-local-media-path {limits.local_path}",
            param=reference.param,
            code="invalid_image_url",
        )
    try:
        if path.stat().st_size > max_bytes:
            raise _too_large(reference, max_bytes)
        return path.read_bytes()
    except OSError as exc:
        raise _failed(reference, exc.strerror or type(exc).__name__) from None


async def _fetch(reference: MediaReference, max_bytes: int, limits: FetchLimits) -> bytes:
    url = reference.url
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=None) as client:
        for _ in range(MAX_REDIRECTS + 1):
            request = await _pinned_request(client, reference, url, limits)
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise _failed(reference, _reason(exc)) from None
            try:
                if response.is_redirect:
                    if not limits.allow_redirects:
                        why = "redirects are off (VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)"
                        raise _failed(reference, f"HTTP {response.status_code}: {why}")
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise _failed(reference, f"HTTP {response.status_code} {response.reason_phrase}".rstrip())
                return await _body(reference, response, max_bytes)
            finally:
                await response.aclose()
    raise _failed(reference, f"more than {MAX_REDIRECTS} redirects")


async def _pinned_request(
    client: httpx.AsyncClient, reference: MediaReference, url: str, limits: FetchLimits
) -> httpx.Request:
    """A GET of ``url`` to the address its host resolved to, once checked: the host is allowed, and its addresses
    are all global unless it is listed in ``--allowed-media-domains``."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise APIError(
            400, f"{reference.label}: not a valid URL ({exc})", param=reference.param, code="invalid_image_url"
        ) from None
    host = parsed.host
    if parsed.scheme not in ("http", "https") or not host:
        raise _failed(reference, f"{_short(url)} is not an http(s) URL with a host")
    listed = host in limits.allowed_domains
    if limits.allowed_domains and not listed:
        raise APIError(
            400,
            f"{reference.label}: the host {host!r} is not allowed; allowed: {', '.join(limits.allowed_domains)} "
            "(--allowed-media-domains)",
            param=reference.param,
            code="image_url_not_allowed",
        )
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise _failed(reference, f"the host {host!r} could not be resolved ({exc})") from None
    addresses = list(dict.fromkeys(_address(info[4][0]) for info in infos))
    private = [a for a in addresses if not _is_public(a)]
    if private and not listed:
        raise APIError(
            400,
            f"{reference.label}: the host {host!r} resolves to a non-public address ({private[0]}); the operator "
            "allows such a host only by listing it in --allowed-media-domains",
            param=reference.param,
            code="image_url_not_allowed",
        )
    address = addresses[0]
    headers = {"Host": parsed.netloc.decode("ascii"), "Accept": "image/*"}
    extensions = {"sni_hostname": host} if parsed.scheme == "https" else {}
    return client.build_request("GET", parsed.copy_with(host=str(address)), headers=headers, extensions=extensions)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    address = ipaddress.ip_address(text.split("%", 1)[0])  # an IPv6 zone index is not part of the address
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A global unicast address (not private, loopback, link-local, shared, reserved, multicast...)."""
    return address.is_global and not address.is_multicast


async def _body(reference: MediaReference, response: httpx.Response, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(reference, max_bytes, int(declared))
    chunks, size = [], 0
    try:
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(reference, max_bytes)
            chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise _failed(reference, _reason(exc)) from None
    return b"".join(chunks)


def _reason(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"could not connect ({exc or 'refused'})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _short(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."


def _failed(reference: MediaReference, reason: str, code: str = "image_url_failed") -> APIError:
    return APIError(
        400, f"{reference.label}: could not fetch {_short(reference.url)}: {reason}", param=reference.param, code=code
    )


def _too_large(reference: MediaReference, max_bytes: int, size: int | None = None) -> APIError:
    what = "is" if size is None else f"is {size} bytes,"
    return APIError(
        400,
        f"{reference.label} {what} above the limit of {max_bytes} bytes (--max-input-image-bytes)",
        param=reference.param,
        code="image_too_large",
    )
