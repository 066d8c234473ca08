"""Every ``vllm_omni:*`` metric, defined once. Served by ``GET /metrics``; see docs/serving.md."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

batch_size = Histogram(
    "vllm_omni:diffusion_batch_size",
    "Requests in each executed diffusion batch (one observation per pipeline call).",
    ["stage", "task"],
    buckets=_BATCH_BUCKETS,
)
queue_time = Histogram(
    "vllm_omni:request_queue_time_seconds",
    "Time a request waited from arrival until its batch started.",
    ["stage", "task"],
    buckets=_SECONDS_BUCKETS,
)
batch_execution_time = Histogram(
    "vllm_omni:batch_execution_time_seconds",
    "Wall time of each executed diffusion batch (one pipeline call).",
    ["stage", "task"],
    buckets=_SECONDS_BUCKETS,
)
oom_batch_splits = Counter(
    "vllm_omni:oom_batch_splits",
    "Batches that ran out of device memory and were split in halves and retried.",
    ["stage"],
)
num_requests_running = Gauge(
    "vllm_omni:num_requests_running", "Requests in the batch now running.", ["stage"]
)
num_requests_waiting = Gauge(
    "vllm_omni:num_requests_waiting", "Requests waiting to be scheduled.", ["stage"]
)
stage_max_num_seqs = Gauge(
    "vllm_omni:stage_max_num_seqs",
    "Resolved max_num_seqs of each stage, labelled with the layer it came from.",
    ["stage", "source"],
)
video_requests = Counter(
    "vllm_omni:video_generation_requests",
    "Video generation jobs by outcome: completed, invalid, overloaded, unavailable, failed, cancelled.",
    ["outcome"],
)
image_requests = Counter(
    "vllm_omni:image_generation_requests",
    "Image generation requests by outcome: completed, invalid, overloaded, unavailable, failed, aborted "
    "(requests refused for a missing or wrong API key are not counted).",
    ["outcome"],
)
