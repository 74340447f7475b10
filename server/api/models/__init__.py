"""/v1/models and the utilities around the served model: /tokenize, /detokenize, /tokenizer_info, /version
(router.py, protocol.py)."""
