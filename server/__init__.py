"""linserve serving side: CLI, engine and HTTP server (imports model/, never the reverse)."""
