"""POST /v1/chat/completions: router.py (the route, tool calls parsed from the text, the answer or its chunks),
protocol.py (the request, the answer's models). Messages and rendering them into the prompt — the tokenizer's
chat template, else linserve's plain one — are common (common/chat.py): /v1/responses and /tokenize use them too."""
