"""Sessions: records and turns (`records`), their snapshot codec (`snapshot`), the engine-thread registry of
tiers (`registry`), the stores below it (`stores`, `redis_store`), the one thread that talks to a store
(`worker`), what a command reads from the store first (`leases`), listings (`listing`) and the commands
the engine exposes as `engine.sessions` (`service`)."""
