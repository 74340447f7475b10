"""What every endpoint family shares: errors (the OpenAI error shape, handlers), dependencies (settings,
tokenizer, the API key, prompt encoding, the model check), generation (start a request in the engine, collect
or stream its outputs, logprobs), streaming (engine outputs into asyncio, server-sent events), chunks, openapi,
metrics, the logprob budget, structured outputs and tools (grammar fields on the requests), and protocol (the
fields and shapes several families' models are made of)."""
