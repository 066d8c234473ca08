"""The playground: ``GET /`` and ``GET /playground`` serve one static page that calls the public API from the browser.

The page is public (no API key): it holds no data, and it sends the key the user types with each API call it makes.
``--disable-playground`` leaves these routes out, so that they answer 404.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = "static/playground.html"
"""The page, shipped as package data (pyproject.toml); plain HTML, CSS and JavaScript, nothing fetched elsewhere."""


def build_playground_router() -> APIRouter:
    # Read once, when the app is built: the page never changes while the server runs.
    page = resources.files(__package__).joinpath(PAGE).read_text(encoding="utf-8")

    async def playground() -> HTMLResponse:
        return HTMLResponse(page)

    router = APIRouter()
    for path in ("/", "/playground"):
        # Not in the OpenAPI schema: a page for people, not part of the API.
        router.add_api_route(path, playground, methods=["GET"], include_in_schema=False)
    return router
