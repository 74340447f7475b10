"""POST /v1/chat/completions: router.py (the route, tool calls parsed from the text, the answer or its chunks),
protocol.py (messages, the request, the answer's models), prompt.py (messages → the prompt: the tokenizer's
chat template, else linserve's plain one; also used by /v1/responses and /tokenize)."""
