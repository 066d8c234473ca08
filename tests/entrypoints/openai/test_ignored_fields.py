"""A field that the served model would not use is never silent (docs/serving.md, "Ignored fields"): by default it is
accepted and dropped (the answer equals the one without it, same seed), with a ``Warning: 299 - "..."`` header
naming it and why, one log line per request and ``vllm_omni:ignored_fields_total{api,field}``; on images, edits,
chat, streams and videos. ``--strict-fields`` refuses it with the 400 it always had. Unknown fields and wrong
values are 400 either way. Upstream vllm-omni's example clients (vllm-project/vllm-omni, examples/online_serving)
are replayed as they send their requests."""

import base64
import io
import json
import re

import av
import httpx
import numpy as np
import pytest

from vllm_omni.testing.checks.edits import noise_image
from vllm_omni.testing.processes.server import RemoteOmniServer, finished_video_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-test"  # the shared servers' (conftest.py), and these
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FAST = {"size": "32x32", "num_inference_steps": 2, "seed": 5}
VIDEO = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2, "fps": 8, "seed": 3}
_WARNING = re.compile(r'299 - "((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def strict_flux(tiny_flux):
    with RemoteOmniServer(tiny_flux, ["--api-key", API_KEY, "--strict-fields"]) as server:
        yield server


@pytest.fixture(scope="module")
def strict_wan(tiny_wan):
    with RemoteOmniServer(tiny_wan, ["--api-key", API_KEY, "--strict-fields"]) as server:
        yield server


@pytest.fixture(scope="module")
def schnell(tiny_flux_schnell):
    """A timestep-distilled Flux: its transformer has no guidance embedding."""
    with RemoteOmniServer(tiny_flux_schnell, ["--api-key", API_KEY]) as server:
        yield server


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url_for(*path.strip("/").split("/")), headers=AUTH, timeout=300, **kwargs)


def warned(response: httpx.Response) -> dict[str, str]:
    """The answer's ``Warning`` values, field → why (each ``299 - "<field> ignored: <why>"``)."""
    texts = _WARNING.findall(response.headers.get("warning", ""))
    assert response.headers.get("warning", "") == ", ".join(f'299 - "{text}"' for text in texts)  # nothing else
    return dict(text.replace('\\"', '"').split(" ignored: ", 1) for text in texts)


def ignored_count(server, api: str, field: str) -> float:
    for line in httpx.get(server.url_for("metrics"), timeout=60).text.splitlines():
        if line.startswith(f'vllm_omni:ignored_fields_total{{api="{api}",field="{field}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def log_lines(server, path: str) -> list[str]:
    """The server's log lines that report a request's ignored fields on ``path`` (written before it answers)."""
    with open(server.log_path, errors="replace") as log:
        return [line for line in log if f"(POST {path}): " in line and " ignored: " in line]


def image(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


def chat_image(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    url = response.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    return base64.b64decode(url.split(",", 1)[1])


def frames(mp4: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(mp4)) as container:
        return [frame.to_ndarray(format="rgb24").astype(np.int16) for frame in container.decode(video=0)]


def same_video(a: bytes, b: bytes) -> bool:
    """x264's output is not bit-reproducible on a loaded machine: the same frames, on average."""
    pairs = list(zip(frames(a), frames(b), strict=True))
    return bool(pairs) and max(np.abs(x - y).mean() for x, y in pairs) <= 3


@pytest.mark.parametrize(
    ("extra", "fields", "words"),
    [
        ({"negative_prompt": "blurry"}, ["negative_prompt"], ("true_cfg_scale > 1",)),
        ({"negative_prompt": "blurry", "true_cfg_scale": 1.0}, ["negative_prompt"], ("true_cfg_scale > 1",)),
        ({"true_cfg_scale": 3.0}, ["true_cfg_scale"], ("without a negative_prompt",)),
    ],
)
def test_an_image_request_is_answered_without_the_field_and_warned(flux_server, extra, fields, words):
    """Flux guides with a negative prompt only under true CFG: either alone is dropped, and the image is the one
    the request makes without it."""
    path = "/v1/images/generations"
    counts = [ignored_count(flux_server, "images", field) for field in fields]
    logged = len(log_lines(flux_server, path))
    response = post(flux_server, path, json={"prompt": "a fox", **FAST, **extra})
    assert image(response) == image(post(flux_server, path, json={"prompt": "a fox", **FAST}))
    why = warned(response)
    assert list(why) == fields and all(word in why[fields[0]] for word in words), why
    assert [ignored_count(flux_server, "images", field) for field in fields] == [n + 1 for n in counts]
    new = log_lines(flux_server, path)[logged:]
    assert len(new) == 1 and all(f"{field} ignored: " in new[0] for field in fields), new


def test_an_answer_without_ignored_fields_has_no_warning(flux_server):
    guided = {"prompt": "a fox", **FAST, "negative_prompt": "blurry", "true_cfg_scale": 3.0}
    response = post(flux_server, "/v1/images/generations", json=guided)
    assert response.status_code == 200 and "warning" not in response.headers


def test_unknown_fields_and_wrong_values_stay_refused(flux_server):
    for body, param in [
        ({"cfg": 4.0}, "cfg"),
        ({"guidance_scale": -1}, "guidance_scale"),
        ({"size": "33x33"}, "size"),  # not a multiple of what Flux needs
    ]:
        response = post(
            flux_server, "/v1/images/generations", json={"prompt": "a fox", "num_inference_steps": 2, **body}
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert "warning" not in response.headers


def test_an_edit_is_answered_without_the_field_and_warned(flux_server):
    source = io.BytesIO()
    noise_image(4, size=32).save(source, format="PNG")
    form = {"prompt": "a blue square", "num_inference_steps": "2", "seed": "3", "strength": "0.8"}

    def edit(**fields) -> httpx.Response:
        files = {"image": ("in.png", source.getvalue(), "image/png")}
        return post(flux_server, "/v1/images/edits", files=files, data={**form, **fields})

    count = ignored_count(flux_server, "images", "true_cfg_scale")
    logged = len(log_lines(flux_server, "/v1/images/edits"))
    response = edit(true_cfg_scale="4")
    assert image(response) == image(edit())
    assert list(warned(response)) == ["true_cfg_scale"]
    assert ignored_count(flux_server, "images", "true_cfg_scale") == count + 1
    assert len(log_lines(flux_server, "/v1/images/edits")) == logged + 1


def test_a_stream_carries_the_warning_from_its_first_bytes(flux_server):
    body = {"prompt": "a kite", **FAST, "stream": True, "partial_images": 1}
    count = ignored_count(flux_server, "images", "negative_prompt")
    url = flux_server.url_for("v1", "images", "generations")
    streamed = {}
    for extra in ({"negative_prompt": "blurry"}, {}):
        with httpx.stream("POST", url, json={**body, **extra}, headers=AUTH, timeout=300) as response:
            assert response.status_code == 200
            streamed[bool(extra)] = (dict(response.headers), response.read().decode())
    headers, events = streamed[True]
    assert list(warned(httpx.Response(200, headers=headers))) == ["negative_prompt"]
    assert "warning" not in streamed[False][0]
    completed = [line for line in events.splitlines() if '"type":"image_generation.completed"' in line]
    plain = [line for line in streamed[False][1].splitlines() if '"type":"image_generation.completed"' in line]
    assert len(completed) == 1 and _b64(completed[0]) == _b64(plain[0])
    assert ignored_count(flux_server, "images", "negative_prompt") == count + 1


def _b64(data_line: str) -> str:
    return re.search(r'"b64_json":"([^"]+)"', data_line)[1]


def test_upstreams_quick_start_chat_request_is_answered_with_a_warning(flux_server):
    """examples/online_serving/text_to_image/README.md's request (and openai_chat_client.py's, whose --cfg-scale
    defaults to 4.0) sends true_cfg_scale 4.0 without a negative prompt, which got a 400, so the client printed
    "Failed to generate image". Smaller here; answered as upstream's reader reads it, with the warning."""
    extra = {"height": 32, "width": 32, "num_inference_steps": 2, "seed": 42, "num_outputs_per_prompt": 1}
    body = {"messages": [{"role": "user", "content": "A beautiful landscape painting"}], "extra_body": extra}
    count = ignored_count(flux_server, "images", "true_cfg_scale")
    logged = len(log_lines(flux_server, "/v1/chat/completions"))
    response = post(flux_server, "/v1/chat/completions", json={**body, "extra_body": {**extra, "true_cfg_scale": 4.0}})
    assert chat_image(response) == chat_image(post(flux_server, "/v1/chat/completions", json=body))
    why = warned(response)
    assert list(why) == ["true_cfg_scale"] and "negative_prompt" in why["true_cfg_scale"]
    assert ignored_count(flux_server, "images", "true_cfg_scale") == count + 1
    assert len(log_lines(flux_server, "/v1/chat/completions")) == logged + 1


def test_upstreams_guidance_scale_to_a_timestep_distilled_flux_is_warned(schnell):
    """examples/online_serving/image_to_image/openai_chat_client.py sends guidance_scale (its --guidance defaults to
    7.5) with an image part; on FLUX.1-schnell it does nothing: no guidance embedding. Also its Images API form."""
    source = io.BytesIO()
    noise_image(4, size=32).save(source, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(source.getvalue()).decode()
    content = [{"type": "text", "text": "a blue square"}, {"type": "image_url", "image_url": {"url": data_url}}]
    extra = {"num_inference_steps": 2, "seed": 3}
    body = {"messages": [{"role": "user", "content": content}], "extra_body": extra}
    count = ignored_count(schnell, "images", "guidance_scale")
    response = post(schnell, "/v1/chat/completions", json={**body, "extra_body": {**extra, "guidance_scale": 7.5}})
    assert chat_image(response) == chat_image(post(schnell, "/v1/chat/completions", json=body))
    why = warned(response)
    assert list(why) == ["guidance_scale"] and "no guidance embedding" in why["guidance_scale"]

    plain = {"prompt": "a fox", **FAST}
    generated = post(schnell, "/v1/images/generations", json={**plain, "guidance_scale": 3.5})
    assert image(generated) == image(post(schnell, "/v1/images/generations", json=plain))
    assert list(warned(generated)) == ["guidance_scale"]
    assert ignored_count(schnell, "images", "guidance_scale") == count + 2
    assert len(log_lines(schnell, "/v1/chat/completions")) == len(log_lines(schnell, "/v1/images/generations")) == 1


@pytest.mark.parametrize(
    ("extra", "fields"),
    [
        ({"true_cfg_scale": 2.0}, ["true_cfg_scale"]),  # Wan's guidance_scale is true guidance already
        ({"guidance_scale_2": 2.0, "boundary_ratio": 0.5}, ["guidance_scale_2", "boundary_ratio"]),  # one expert
        ({"negative_prompt": "blurry", "guidance_scale": 1.0}, ["negative_prompt"]),
    ],
)
def test_a_video_is_made_without_the_field_and_warned(wan_server, extra, fields):
    counts = [ignored_count(wan_server, "videos", field) for field in fields]
    body = {"prompt": "a cat", **VIDEO}
    if "guidance_scale" in extra:
        body["guidance_scale"] = extra["guidance_scale"]  # the run without the field has it too
    synced = post(wan_server, "/v1/videos/sync", json={**body, **extra})
    assert synced.status_code == 200, synced.text
    assert same_video(synced.content, post(wan_server, "/v1/videos/sync", json=body).content)
    assert list(warned(synced)) == fields
    job = post(wan_server, "/v1/videos", json={**body, **extra})
    assert job.status_code == 200 and list(warned(job)) == fields  # the job's create answer
    assert finished_video_job(wan_server.base_url, job.json()["id"], AUTH)["status"] == "completed"
    assert [ignored_count(wan_server, "videos", field) for field in fields] == [n + 2 for n in counts]


def test_a_video_models_chat_answer_carries_the_warning(wan_server):
    extra = {"num_frames": 5, "num_inference_steps": 2, "width": 32, "height": 32, "seed": 1, "boundary_ratio": 0.5}
    body = {"messages": [{"role": "user", "content": "a cat"}], "extra_body": extra}
    count = ignored_count(wan_server, "videos", "boundary_ratio")
    response = post(wan_server, "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert list(warned(response)) == ["boundary_ratio"]
    assert ignored_count(wan_server, "videos", "boundary_ratio") == count + 1


@pytest.mark.parametrize(
    ("extra", "param", "names"),
    [
        ({"negative_prompt": "blurry"}, "negative_prompt", ("negative_prompt", "true_cfg_scale")),
        ({"negative_prompt": "blurry", "true_cfg_scale": 1.0}, "negative_prompt", ("true_cfg_scale > 1",)),
        ({"true_cfg_scale": 3.0}, "true_cfg_scale", ("negative_prompt",)),
    ],
)
def test_strict_fields_refuses_a_field_that_would_do_nothing_naming_the_fix(strict_flux, extra, param, names):
    """Flux guides with a negative prompt only under true CFG: under --strict-fields, either alone is a 400."""
    count = ignored_count(strict_flux, "images", param)
    for stream in (False, True):
        body = {"prompt": "a fox", **FAST, **extra, "stream": stream}
        response = post(strict_flux, "/v1/images/generations", json=body)
        assert response.status_code == 400 and "warning" not in response.headers, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "invalid_value")
        assert all(name in error["message"] for name in names), error
    assert ignored_count(strict_flux, "images", param) == count == 0


def test_strict_fields_refuses_upstreams_chat_and_edit_requests(strict_flux):
    """Upstream's quick-start chat body with true_cfg_scale 4.0 alone is refused naming true_cfg_scale, and with a
    negative prompt it runs; so is an edit's."""
    body = {"messages": [{"role": "user", "content": "a red fox"}], "extra_body": {**FAST, "true_cfg_scale": 4.0}}
    refused = post(strict_flux, "/v1/chat/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "true_cfg_scale"
    assert "negative_prompt" in refused.json()["error"]["message"]
    body["extra_body"]["negative_prompt"] = "blurry"
    assert post(strict_flux, "/v1/chat/completions", json=body).status_code == 200
    source = io.BytesIO()
    noise_image(4, size=32).save(source, format="PNG")
    files = {"image": ("in.png", source.getvalue(), "image/png")}
    edit = post(strict_flux, "/v1/images/edits", files=files, data={"prompt": "x", "true_cfg_scale": "4"})
    assert edit.status_code == 400 and edit.json()["error"]["param"] == "true_cfg_scale"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"true_cfg_scale": 2.0}, "true_cfg_scale"),
        ({"guidance_scale_2": 2.0}, "guidance_scale_2"),  # one expert: Wan 2.2's knobs need two
        ({"boundary_ratio": 0.5}, "boundary_ratio"),
        ({"negative_prompt": "blurry", "guidance_scale": 1.0}, "negative_prompt"),
    ],
)
def test_strict_fields_refuses_video_fields_naming_them(strict_wan, fields, param):
    body = {"prompt": "a cat", "num_frames": 5, "num_inference_steps": 2, **fields}
    for path in ("/v1/videos", "/v1/videos/sync"):
        response = post(strict_wan, path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


# OpenAI's SDK: every field of its request types is served here or reported as ignored, never refused as unknown.

SDK_SAMPLES = {
    "n": 1,
    "size": "32x32",
    "quality": "low",
    "response_format": "b64_json",
    "output_format": "jpeg",
    "background": "opaque",
    "partial_images": 0,  # previews need stream; 0 is served without one
    "svg": {},
    "seconds": "4",
}
"""A value of each SDK field that this server takes (its sizes, not OpenAI's 1024x1024); a field not listed gets
one from its type (`_sample`)."""


def _sample(name: str, kind) -> object:
    """A value for the SDK field ``name`` of type ``kind``: `SDK_SAMPLES`', else its first literal, else by type."""
    import typing

    if name in SDK_SAMPLES:
        return SDK_SAMPLES[name]
    args = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
    for arg in args:
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)[0]
    return 1 if int in args else "user-1" if str in args else "x"


def _sdk_fields(params) -> dict[str, object]:
    """The SDK TypedDict's fields and their types (its required and optional keys)."""
    import typing

    hints = typing.get_type_hints(params)
    assert set(hints) == params.__required_keys__ | params.__optional_keys__
    return hints


def _served(model, name: str) -> bool:
    """A declared field of the request model that acts (not one it accepts and ignores, `Ignored`)."""
    from vllm_omni.entrypoints.openai.request_fields import Ignored

    info = model.model_fields.get(name)
    return info is not None and not any(isinstance(m, Ignored) for m in info.metadata)


def test_every_openai_images_field_is_served_or_reported_as_ignored(flux_server):
    """Each field of openai-python's ``ImageGenerateParams`` and ``ImageEditParams``, sent alone with a value this
    server takes: accepted (200); a field that changes nothing here (``style``, ``moderation``, ``input_fidelity``,
    ``output_compression`` with png, ...) with a ``Warning`` naming it; never ``unknown_parameter``."""
    from openai.types import image_edit_params, image_generate_params

    from vllm_omni.entrypoints.openai.images.edit_form import FILE_FIELDS
    from vllm_omni.entrypoints.openai.protocol import ImageEditRequest, ImageGenerationRequest

    source = io.BytesIO()
    noise_image(4, size=32).save(source, format="PNG")
    png = source.getvalue()
    mask = io.BytesIO()
    noise_image(4, size=32).convert("RGBA").save(mask, format="PNG")  # opaque: nothing to repaint, but a mask
    base = {"num_inference_steps": 2, "seed": 1}
    checked = []
    for params, model, path in (
        (image_generate_params.ImageGenerateParamsBase, ImageGenerationRequest, "/v1/images/generations"),
        (image_edit_params.ImageEditParamsBase, ImageEditRequest, "/v1/images/edits"),
    ):
        for name, kind in _sdk_fields(params).items():
            if name in ("prompt", "image"):  # sent with every request
                continue
            value = flux_server.model if name == "model" else _sample(name, kind)
            if path.endswith("edits"):
                files = [("image", ("in.png", png, "image/png"))]
                data = {"prompt": "a fox", **{k: str(v) for k, v in base.items()}}
                if name in ("mask", "markup"):  # files
                    files.append((name, (f"{name}.png", mask.getvalue(), "image/png")))
                else:
                    data[name] = json.dumps(value) if isinstance(value, dict) else str(value)
                response = post(flux_server, path, files=files, data=data)
            else:
                response = post(flux_server, path, json={"prompt": "a fox", "size": "32x32", **base, name: value})
            assert response.status_code == 200, (path, name, response.text)
            why = warned(response)
            if (_served(model, name) or name in FILE_FIELDS) and name != "output_compression":  # with png: ignored
                assert name not in why, (path, name, why)
            else:
                assert name in why, (path, name, response.headers.get("warning"))
            checked.append((path, name))
    assert ("/v1/images/edits", "input_fidelity") in checked and ("/v1/images/generations", "style") in checked


def test_every_openai_videos_field_is_served(wan_server):
    """Each field of openai-python's ``VideoCreateParams`` is a field of the Videos API (``input_reference``: an
    image-to-video model's file, which this text-to-video model refuses as such, not as unknown)."""
    from openai.types import video_create_params

    from vllm_omni.entrypoints.openai.protocol import VideoGenerationRequest

    png = io.BytesIO()
    noise_image(4, size=32).save(png, format="PNG")
    for name, kind in _sdk_fields(video_create_params.VideoCreateParams).items():
        body = {"prompt": "a cat", "size": "32x32", "num_frames": 5, "num_inference_steps": 2, "fps": 8}
        if name == "input_reference":
            files = {"input_reference": ("in.png", png.getvalue(), "image/png")}
            response = post(wan_server, "/v1/videos/sync", files=files, data={k: str(v) for k, v in body.items()})
            error = response.json()["error"]
            assert (response.status_code, error["param"], error["code"]) == (400, "model", "model_not_supported")
            continue
        if name == "seconds":  # instead of num_frames: 4 s at 1 fps is 5 frames on Wan
            body = {**{k: v for k, v in body.items() if k != "num_frames"}, "fps": 1}
        if name == "size":
            body.pop("size")
        value = wan_server.model if name == "model" else _sample(name, kind)
        response = post(wan_server, "/v1/videos/sync", json={**body, name: value})
        assert response.status_code == 200, (name, response.text)
        assert _served(VideoGenerationRequest, name) and "warning" not in response.headers, name


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"output_format": "png", "output_compression": 50}, "output_compression"),
        ({"style": "vivid"}, "style"),
        ({"moderation": "low"}, "moderation"),
    ],
)
def test_strict_fields_refuses_openais_fields_that_change_nothing(strict_flux, fields, param):
    response = post(strict_flux, "/v1/images/generations", json={"prompt": "a fox", **FAST, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value") and "--strict-fields" in error["message"]


def test_input_fidelity_of_an_edit_is_warned_and_refused_under_strict_fields(flux_server, strict_flux):
    source = io.BytesIO()
    noise_image(4, size=32).save(source, format="PNG")
    files = {"image": ("in.png", source.getvalue(), "image/png")}
    form = {"prompt": "a blue square", "num_inference_steps": "2", "seed": "3", "input_fidelity": "high"}
    count = ignored_count(flux_server, "images", "input_fidelity")
    response = post(flux_server, "/v1/images/edits", files=files, data=form)
    assert list(warned(response)) == ["input_fidelity"] and image(response)
    assert ignored_count(flux_server, "images", "input_fidelity") == count + 1
    refused = post(strict_flux, "/v1/images/edits", files=files, data=form)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input_fidelity", refused.text
