"""`linserve serve`: uvicorn running the app; on SIGTERM/SIGINT running streams end first (`abort`)."""

from __future__ import annotations

import logging

import uvicorn

from .app import create_app, drain
from .settings import Settings


class DrainingServer(uvicorn.Server):
    """uvicorn waits for open connections before the lifespan ends; streams never end by themselves,
    so the engine is drained first: every stream gets its final `abort` event and closes."""

    async def shutdown(self, sockets=None) -> None:
        await drain(self.config.app)
        await super().shutdown(sockets)


def serve(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=10)
    DrainingServer(config).run()
