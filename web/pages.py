"""Serving the browser pages (web/__init__.py says what they are) from a FastAPI app."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from web import STATIC, STATIC_PREFIX


def install_pages(app: FastAPI, pages: dict[str, str]) -> None:
    """Serves the static files under STATIC_PREFIX, and each page (a file of STATIC) at its path."""
    app.mount(STATIC_PREFIX.rstrip("/"), StaticFiles(directory=STATIC), name="static")
    for path, name in pages.items():
        app.add_api_route(path, _page(STATIC / name), methods=["GET"], include_in_schema=False)


def _page(file: Path):
    async def page() -> FileResponse:
        return FileResponse(file, media_type="text/html")
    return page
