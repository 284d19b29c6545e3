"""GET /: the dashboard, one static page served by every peer.

The page polls this peer's /status (so it needs no route to the other peers),
draws the mesh from it, and streams a chat completion through this peer's
/v1/chat/completions, the same way any OpenAI client would. Its live charts poll
/live every second (the supernode's samples, relayed by a member: serving/observe.py)
and draw them as hand-written SVG; a request's timeline comes from /traces/{id}. The
page loads nothing else: no build step, no script from anywhere but this page.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

PAGE = "dashboard.html"


def page_bytes() -> bytes:
    return resources.files("meshd.serving").joinpath("static", PAGE).read_bytes()


async def index(request: web.Request) -> web.Response:
    return web.Response(body=page_bytes(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", index)
