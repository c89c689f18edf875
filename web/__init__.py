"""The browser pages: a chat page (`/`, on the server and on the proxy) and the proxy's operator page
(`/ui`). Plain files served as they are: no build step, nothing loaded from elsewhere. The pages and
their files need no API key (server.protocol.is_open); they ask for one when an API call is refused
and send it with every call. `web.pages.install_pages` serves them.

This package depends on nothing of tandem's; this module imports nothing at all, so the wire
models can name the pages' prefix without loading a web framework."""
from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).with_name("static")
STATIC_PREFIX = "/static/"  # where the pages' files are served
