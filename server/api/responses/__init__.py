"""/v1/responses (OpenAI's Responses API over linserve's sessions): router.py (create, retrieve, delete,
input_items), protocol.py (the request and its input items), events.py (the response object and its stream of
typed events)."""
