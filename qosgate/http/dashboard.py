"""GET /dashboard: the live page (it reads /admin/stats from the browser).
"""

from __future__ import annotations

import importlib.resources

from aiohttp import web


_DASHBOARD: bytes | None = None


async def dashboard_page(request: web.Request) -> web.Response:
    """The live page. It carries no data: the browser reads /admin/stats with
    the admin token, given once as `/dashboard#token=...` (a fragment never
    reaches a server or its logs) or typed into the page."""
    global _DASHBOARD
    if _DASHBOARD is None:
        _DASHBOARD = (
            importlib.resources.files("qosgate.http").joinpath("static/dashboard.html").read_bytes()
        )
    return web.Response(
        body=_DASHBOARD,
        content_type="text/html",
        charset="utf-8",
        headers={"Cache-Control": "no-cache", "Content-Security-Policy": "default-src 'self'; "
                 "script-src 'unsafe-inline'; style-src 'unsafe-inline'"},
    )
