"""The codec stage's window queue: a decode call takes windows of one shape, at most max_num_seqs, the most urgent
first (the stream nearest to running out of audio, or the oldest window), priority first under the priority
policy; an aborted request's waiting windows fail."""

import threading

import numpy as np
import pytest

from vllm_omni.codec.engine.window_queue import WindowJob, WindowQueue
from vllm_omni.codec.pipeline.codecs import CodeWindow
from vllm_omni.errors import RequestAbortedError


def _job(request_id: str, frames: int, due: float, arrived: float, priority: int = 0) -> WindowJob:
    window = CodeWindow(np.zeros((frames, 7), dtype=np.int64), 0, 0)
    return WindowJob(request_id, window, due, priority, arrived=arrived)


def _taken(queue: WindowQueue) -> list[str]:
    batch = queue.take()
    assert batch is not None
    return [job.request_id for job in batch]


def test_a_call_takes_the_most_urgent_window_then_others_of_its_shape_up_to_max_num_seqs():
    queue = WindowQueue(capacity=2, order="underrun", by_priority=False)
    for job in [_job("a", 4, due=5, arrived=0), _job("b", 8, due=1, arrived=1), _job("c", 8, due=9, arrived=2)]:
        queue.add(job)
    queue.add(_job("d", 8, due=3, arrived=3))
    assert _taken(queue) == ["b", "d"]  # b is due first; d is the next of b's shape; c waits: max_num_seqs 2
    assert _taken(queue) == ["a"]
    assert _taken(queue) == ["c"]


def test_arrival_order_takes_the_oldest_window_whatever_its_stream_holds():
    queue = WindowQueue(capacity=1, order="arrival", by_priority=False)
    queue.add(_job("late-but-starving", 4, due=0, arrived=2))
    queue.add(_job("old", 4, due=9, arrived=1))
    assert _taken(queue) == ["old"]


def test_priority_comes_before_urgency_under_the_priority_policy_only():
    jobs = [_job("urgent", 4, due=0, arrived=0, priority=5), _job("important", 4, due=9, arrived=1, priority=-1)]
    for by_priority, first in [(True, "important"), (False, "urgent")]:
        queue = WindowQueue(capacity=1, order="underrun", by_priority=by_priority)
        for job in jobs:
            queue.add(job)
        assert _taken(queue) == [first]


def test_aborting_a_request_fails_its_waiting_windows_and_leaves_the_others():
    queue = WindowQueue(capacity=4, order="underrun", by_priority=False)
    gone, kept = _job("gone", 4, due=0, arrived=0), _job("kept", 4, due=1, arrived=1)
    queue.add(gone)
    queue.add(kept)
    assert queue.abort("gone") and not queue.abort("gone")
    with pytest.raises(RequestAbortedError):
        gone.future.result(timeout=0)
    assert _taken(queue) == ["kept"]


def test_take_waits_for_a_window_and_answers_none_once_closed_and_empty():
    queue = WindowQueue(capacity=1, order="underrun", by_priority=False)
    taken: list = []
    taker = threading.Thread(target=lambda: taken.append(queue.take()))
    taker.start()
    queue.add(_job("a", 4, due=0, arrived=0))
    taker.join()
    assert [job.request_id for job in taken[0]] == ["a"]
    queue.close()
    assert queue.take() is None
    with pytest.raises(RuntimeError, match="shutting down"):
        queue.add(_job("b", 4, due=0, arrived=0))
