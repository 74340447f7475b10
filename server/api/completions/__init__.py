"""POST /v1/completions: router.py (the route). The request and answer models (common/completion_protocol.py) and
the work — encode, generate, answer or stream (common/completion_serving.py) — are common: a session's
completions take the same body and run the same way."""
