"""A request whose client goes away is aborted: `until_disconnect` awaits the work or the client's disconnect,
whichever comes first."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it, which aborts its request and frees its slot.

    vLLM's ``with_cancellation`` decorator does not fit: when the server cancels the handler (at the end of the
    shutdown timeout) it leaves the work running instead of aborting it, and it answers 200 to a client that is gone.
    Nor does its ``listen_for_disconnect`` (the same loop as `_disconnected`): importing its module resolves vLLM's
    platform at import time, before the CLI sets the CPU hint, which then fails vLLM's own parser in that process.
    """
    work = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server cancels us (shutdown timeout): abort the request too
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    raise ClientDisconnected


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
