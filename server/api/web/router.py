"""The built-in page at `/` (setting `web_ui`): playground, sessions and live per-token latency, as plain
files shipped in the package (server/api/web/static/) — no build step, nothing fetched from anywhere else.

The page adds no way in: it is public (it holds no data), and every API call it makes carries the key the
user typed, as any client's would. Its Content-Security-Policy allows only this server's own script,
stylesheet and API — no inline script, no other origin — so text from the model or a user can never run.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from ..common.errors import APIError

WEB_DIR = Path(__file__).resolve().parent / "static"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
# read once: a handful of small files, served from memory
FILES = {path.name: path.read_bytes() for path in WEB_DIR.iterdir() if path.suffix in MEDIA_TYPES}

router = APIRouter(include_in_schema=False)


def web_file(name: str) -> Response:
    return Response(FILES[name], media_type=MEDIA_TYPES[Path(name).suffix], headers=HEADERS)


@router.get("/")
async def page() -> Response:
    return web_file("index.html")


@router.get("/favicon.ico")
async def favicon() -> Response:
    """The page's icon where browsers look for it first (an SVG: every current browser takes it)."""
    return web_file("favicon.svg")


@router.get("/web/{name}")
async def asset(name: str) -> Response:
    if name not in FILES:
        raise APIError(404, f"no such file: {name[:64]!r}", "name", code="not_found")
    return web_file(name)
