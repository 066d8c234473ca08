"""Encoded images behind unguessable ids, kept for a limited time and memory budget (``url`` responses)."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from typing import NamedTuple


class StoredImage(NamedTuple):
    data: bytes
    media_type: str
    expires_at: float


class ImageStore:
    def __init__(self, ttl_s: float, max_bytes: int):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._images: OrderedDict[str, StoredImage] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes, media_type: str) -> str | None:
        """Store an image and return its id; ``None`` if it is larger than the whole budget."""
        if len(data) > self.max_bytes:
            return None
        image_id = secrets.token_urlsafe(32)
        with self._lock:
            self._evict(time.monotonic(), room=len(data))
            self._images[image_id] = StoredImage(data, media_type, time.monotonic() + self.ttl_s)
            self._bytes += len(data)
        return image_id

    def get(self, image_id: str) -> StoredImage | None:
        with self._lock:
            self._evict(time.monotonic(), room=0)
            return self._images.get(image_id)

    def _evict(self, now: float, room: int) -> None:
        while self._images:
            oldest_id, oldest = next(iter(self._images.items()))
            if oldest.expires_at > now and self._bytes + room <= self.max_bytes:
                return
            del self._images[oldest_id]
            self._bytes -= len(oldest.data)
