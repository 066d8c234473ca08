"""The package logger: one handler on ``vllm_omni``, level from ``VLLM_OMNI_LOGGING_LEVEL``."""

from __future__ import annotations

import logging
import os

_ROOT = "vllm_omni"
_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def _configure_root() -> None:
    root = logging.getLogger(_ROOT)
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("VLLM_OMNI_LOGGING_LEVEL", "INFO").upper())


def init_logger(name: str) -> logging.Logger:
    _configure_root()
    return logging.getLogger(name)
