"""HTTP routes: thin handlers over the engine (validation in schemas, formatting in generation)."""
