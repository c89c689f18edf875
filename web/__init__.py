"""The browser pages: a chat page (`/`, on the server and on the proxy) and the proxy's operator page
(`/ui`). Plain files served as they are: no build step, nothing loaded from elsewhere. The pages and
their files need no API key (server.protocol.is_open); they ask for one when an API call is refused
and send it with every call."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from server.protocol import STATIC_PREFIX

STATIC = Path(__file__).with_name("static")


def install_pages(app: FastAPI, pages: dict[str, str]) -> None:
    """Serves the static files under STATIC_PREFIX, and each page (a file of STATIC) at its path."""
    app.mount(STATIC_PREFIX.rstrip("/"), StaticFiles(directory=STATIC), name="static")
    for path, name in pages.items():
        app.add_api_route(path, _page(STATIC / name), methods=["GET"], include_in_schema=False)


def _page(file: Path):
    async def page() -> FileResponse:
        return FileResponse(file, media_type="text/html")
    return page
