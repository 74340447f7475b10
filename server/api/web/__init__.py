"""The page at `/` (router.py) and its four static files (static/)."""
