"""The HTTP side, one package per endpoint family (as vLLM's entrypoints/openai/<family>/): each holds its router
(router.py), its request and response models (protocol.py) and how its results become bytes; `common/` is the
machinery they share. Routers never import each other; a family reaches the engine only through
common/generation.py (start_generation, collect) and the engine's session commands."""
