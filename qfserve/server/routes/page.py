"""The chat page: ``GET /`` and its files under ``/page/`` (``--no-webui`` removes them).

Plain HTML, CSS and JavaScript inside the package: no build step, and nothing is fetched
from anywhere but this server (the policy header says so to the browser too), so the page
works offline. It talks to the same OpenAI routes as any client (``/v1/chat/completions``
with SSE, ``/v1/models``, ``/v1/status``) and keeps conversations in the browser's storage,
never on the server.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

FILES = Path(__file__).resolve().parent.parent / "page"
# Everything from this origin only; the page sets its colours from script (CSSOM), which a
# style policy does not govern, so no inline style or script is allowed.
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff"}

router = APIRouter()


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(FILES / "index.html", media_type="text/html", headers=HEADERS)


def files() -> StaticFiles:
    """The page's script and style sheet, mounted at ``/page``."""
    return StaticFiles(directory=FILES)
