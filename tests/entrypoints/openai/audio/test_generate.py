"""``POST /v1/audio/generate`` on one real ``vllm serve`` process (the real CLI, with ``--enforce-eager``) serving the
tiny Stable Audio (stereo, 44.1 kHz, clips of up to 1.49 s), through the ``openai`` client and httpx: every format
decodes with PyAV at the rate and channels its headers state and the length docs/audio.md gives it; ``n`` answers a
zip; ``speed`` stretches the clip; the bad requests get 400s naming the field and what it allows; an ignored field
gets its Warning, or under ``--strict-fields`` its 400; the images and videos APIs refuse the audio model and the
audio API an image model; the playground plays the clip."""

import concurrent.futures
import io
import re
import zipfile
from pathlib import Path

import av
import httpx
import numpy as np
import openai
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from vllm_omni.entrypoints.openai.audio.encoding import AUDIO_FORMATS, FORMATS
from vllm_omni.testing.processes.server import RemoteOmniServer, in_process_server, outcome_count

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
RATE, CHANNELS = 44100, 2  # the tiny model's (vllm_omni/testing/models/tiny_audio.py)
LONGEST = 32 * 2048 / RATE  # its transformer's sample_size × the VAE's hop: 1.486 s
LENGTH = 0.5
FAST = {"num_inference_steps": 2, "seed": 3}
"""Two steps: the tiny model's default is Stable Audio's 100."""

PRIMING = {"mp3": 1105, "aac": 1024}
"""docs/audio.md's decoded lengths: MP3 and ADTS start with this codec delay and end on a whole frame (`FRAME`); the
other formats decode to the samples made (Opus at 48 kHz)."""
FRAME = {"mp3": 1152, "aac": 1024}


@pytest.fixture(scope="module")
def server(tiny_stable_audio):
    """``vllm serve`` of the tiny Stable Audio (vLLM's CLI ``main`` in a preloaded fork, as every server whose promise
    is not the executable itself)."""
    args = ["--api-key", API_KEY, "--max-num-seqs", "6", "--enforce-eager"]
    with RemoteOmniServer(tiny_stable_audio, args) as server:
        yield server
    assert server.returncode == 0


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0, timeout=300)


def generate(client: openai.OpenAI, **body) -> httpx.Response:
    """openai-python has no ``audio.generate``: its generic ``post``, the answer as the raw response."""
    return client.post("/audio/generate", body=body, cast_to=httpx.Response)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url_for("v1", "audio", "generate"), json=body, headers=AUTH, timeout=300)


def decode(data: bytes, response_format: str, rate: int, channels: int) -> tuple[int, int, np.ndarray]:
    """``(rate, channels, samples)`` as PyAV decodes ``data``, the samples ``(channels, n)``; ``pcm`` is read as its
    headers say (it has none of its own)."""
    layout = {1: "mono", 2: "stereo"}[channels]
    options = {"sample_rate": str(rate), "ch_layout": layout} if response_format == "pcm" else {}
    with av.open(io.BytesIO(data), format="s16le" if response_format == "pcm" else None, options=options) as file:
        stream = file.streams.audio[0]
        frames = []
        for frame in file.decode(stream):
            array = frame.to_ndarray()
            frames.append(array if frame.format.is_planar else array.reshape(-1, channels).T)
        context = stream.codec_context
        return context.sample_rate, context.channels, np.concatenate(frames, axis=1)


def test_every_format_decodes_at_its_stated_rate_channels_and_length(server, client):
    """The six formats of one clip (the same seed), asked at once; ``wav`` by leaving ``response_format`` out."""
    completed = outcome_count(server.base_url, "audio_generation_requests", "completed")
    bodies = {fmt: {"input": "rain on a roof", "audio_length": LENGTH, **FAST} for fmt in AUDIO_FORMATS}
    for fmt, body in bodies.items():
        if fmt != "wav":
            body["response_format"] = fmt
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = dict(zip(bodies, pool.map(lambda body: generate(client, **body), bodies.values()), strict=True))
    asked = round(LENGTH * RATE)
    samples = {}
    for fmt, answer in answers.items():
        assert answer.status_code == 200, answer.text
        headers = answer.headers
        assert headers["content-type"] == FORMATS[fmt].media_type
        assert re.fullmatch(rf'attachment; filename="audio-[0-9a-f]{{32}}\.{fmt}"', headers["content-disposition"])
        assert int(headers["x-usage-input-tokens"]) > 0  # the prompt's T5 tokens
        rate, channels = int(headers["x-sample-rate"]), int(headers["x-channels"])
        assert (rate, channels) == ((48000 if fmt == "opus" else RATE), CHANNELS)
        decoded_rate, decoded_channels, samples[fmt] = decode(answer.content, fmt, rate, channels)
        assert (decoded_rate, decoded_channels) == (rate, channels)
        length = samples[fmt].shape[1]
        if fmt in PRIMING:
            assert asked + PRIMING[fmt] <= length < asked + PRIMING[fmt] + FRAME[fmt], (fmt, length)
            assert length % FRAME[fmt] == 0, (fmt, length)
        elif fmt == "opus":
            assert abs(length - asked * 48000 / RATE) <= 1, length
        else:
            assert length == asked, (fmt, length)
    assert np.abs(samples["wav"]).max() > 0.01, "silence"
    # The lossless formats hold the same 16-bit samples of the same clip, to the one or two levels by which batching
    # moves a waveform: which of the six requests share a pipeline call depends on when each arrives (batched =
    # alone is float rounding, gpu_check's audio bar; a format that re-encoded the samples would be far off).
    for fmt in ("pcm", "flac"):
        assert np.abs(samples["wav"].astype(np.int32) - samples[fmt]).max() <= 2, fmt
    assert outcome_count(server.base_url, "audio_generation_requests", "completed") - completed == len(bodies)


def test_n_answers_a_zip_of_waveforms_and_speed_stretches_them(server):
    answer = post(server, {"input": "a dog barking", "audio_length": LENGTH, "n": 2, "speed": 2.0, **FAST})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/zip"
    assert answer.headers["content-disposition"].endswith('.zip"')
    with zipfile.ZipFile(io.BytesIO(answer.content)) as archive:
        assert archive.namelist() == ["audio_0.wav", "audio_1.wav"]
        clips = [decode(archive.read(name), "wav", RATE, CHANNELS)[2] for name in archive.namelist()]
    for clip in clips:  # twice as fast: half the samples (atempo keeps all but a few ms at the edges)
        assert clip.shape[0] == CHANNELS and abs(clip.shape[1] - LENGTH * RATE / 2) < 0.05 * LENGTH * RATE / 2
    assert np.abs(clips[0] - clips[1]).max() > 0.01, "the two waveforms of a request have their own noise"


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"audio_length": 2.0}, "audio_length", f"more than 0 and at most {LONGEST:g}"),
        ({"audio_length": -1.0}, "audio_length", f"more than 0 and at most {LONGEST:g}"),
        ({"audio_start": 1.2, "audio_length": 0.5}, "audio_length", "from audio_start=1.2"),
        ({"audio_start": -0.5}, "audio_start", "0 or more"),
        ({"response_format": "ogg"}, "response_format", "'mp3', 'opus', 'aac', 'flac', 'wav' or 'pcm'"),
        ({"stream_format": "sse"}, "stream_format", "'audio'"),
        ({"speed": 8}, "speed", "less than or equal to 4"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"voice": "alloy"}, "voice", "Unrecognized request argument"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field_and_what_it_allows(server, fields, param, says):
    invalid = outcome_count(server.base_url, "audio_generation_requests", "invalid")
    answer = post(server, {"input": "x", **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert outcome_count(server.base_url, "audio_generation_requests", "invalid") - invalid == 1


def _ignored_count(server, field: str) -> float:
    for line in httpx.get(server.url_for("metrics"), timeout=60).text.splitlines():
        if line.startswith(f'vllm_omni:ignored_fields_total{{api="audio",field="{field}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_field_the_model_would_not_use_is_answered_with_a_warning(server):
    before = _ignored_count(server, "negative_prompt")
    body = {"input": "wind", "audio_length": 0.1, "negative_prompt": "rain", "guidance_scale": 1.0, **FAST}
    answer = post(server, body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["warning"].startswith('299 - "negative_prompt ignored: ')
    assert "unless guidance_scale > 1" in answer.headers["warning"]
    assert _ignored_count(server, "negative_prompt") - before == 1


def test_the_images_and_videos_apis_refuse_the_audio_model_which_v1_models_lists(server, tiny_stable_audio):
    for path, body in ((("images", "generations"), {"prompt": "x"}), (("videos", "sync"), {"prompt": "x"})):
        answer = httpx.post(server.url_for("v1", *path), json=body, headers=AUTH, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == ("model", "model_not_supported")
        assert "is an audio model; this API serves" in error["message"]
    models = httpx.get(server.url_for("v1", "models"), headers=AUTH, timeout=60).json()
    assert [model["id"] for model in models["data"]] == [tiny_stable_audio]


def test_the_audio_apis_refuse_an_image_model(flux_server):
    for method, path, body, kind in (
        ("POST", "generate", {"input": "x"}, "audio"),
        ("POST", "speech", {"input": "x", "voice": "alloy"}, "speech"),
        ("GET", "voices", None, "speech"),
    ):
        answer = httpx.request(method, flux_server.url_for("v1", "audio", path), json=body, headers=AUTH, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "model_not_supported", error
        assert f"is an image model; this API serves {kind} models only" in error["message"]


def test_the_real_vllm_cli_serves_with_enforce_eager(server):
    """vLLM's --enforce-eager (upstream's docs pass it) is accepted and logged as doing nothing here."""
    assert httpx.get(server.url_for("health"), timeout=60).status_code == 200
    log = Path(server.log_path).read_text()
    assert "--enforce-eager: vLLM flag(s) that have no effect on a diffusion server; ignored" in log


@pytest.mark.browser
def test_the_playground_plays_the_clip(server, browser):
    browser.get(server.base_url + "/")
    Select(browser.find_element(By.ID, "mode")).select_by_value("audio")
    for field, text in (("api-key", API_KEY), ("audio-length", str(LENGTH)), ("steps", "2"), ("seed", "4")):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(text)
    assert not browser.find_element(By.ID, "size").is_displayed()
    browser.find_element(By.ID, "generate").click()

    status = browser.find_element(By.ID, "status")
    WebDriverWait(browser, 300).until(lambda _: status.get_attribute("data-state") in ("done", "error"))
    assert status.get_attribute("data-state") == "done", browser.find_element(By.ID, "error").text
    player = browser.find_element(By.ID, "final-audio")
    assert player.is_displayed() and player.get_attribute("src").startswith("blob:")
    # Chromium decoded the WAV's header: the <audio> element knows the clip's length.
    assert browser.execute_script("return arguments[0].readyState", player) >= 1
    assert browser.execute_script("return arguments[0].duration", player) == pytest.approx(LENGTH, abs=1e-3)
    assert f"at {RATE} Hz, {CHANNELS} channel(s)" in status.text


def test_strict_fields_refuses_the_field_the_model_would_not_use(tiny_stable_audio):
    """``--strict-fields``, on an in-process server (no process to start): the same request is a 400 naming it."""
    with in_process_server(tiny_stable_audio, serving={"strict_fields": True}) as (_, base):
        body = {"input": "wind", "negative_prompt": "rain", "guidance_scale": 1.0, "audio_length": 0.1, **FAST}
        answer = httpx.post(f"{base}/v1/audio/generate", json=body, timeout=300)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "negative_prompt" and "unless guidance_scale > 1" in error["message"], error
