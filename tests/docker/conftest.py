"""The deployment facts (routes the server serves, metrics it exports) as fixtures."""

from tests.deploy.facts import exported_metrics, server_routes  # noqa: F401

__all__ = ["exported_metrics", "server_routes"]
