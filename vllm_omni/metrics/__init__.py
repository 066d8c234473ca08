"""Prometheus metrics (``vllm_omni:*``) in the default prometheus_client registry."""
