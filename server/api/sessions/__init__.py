"""/v1/sessions (linserve's own): router.py (create, list, get, continue, fork, export, import, turns, rewind,
delete), protocol.py (their models), idempotency.py (Idempotency-Key and If-Match: what a retry gets back)."""
