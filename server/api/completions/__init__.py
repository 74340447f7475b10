"""POST /v1/completions: router.py (the route), protocol.py (CompletionRequest → engine SamplingParams, the
answer's models), serving.py (encode, generate, answer or stream; session continuations use it too)."""
