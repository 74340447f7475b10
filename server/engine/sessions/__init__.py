"""Sessions: records and turns (`records`), their snapshot codec (`snapshot`), the engine-thread registry
(`registry`) and where each session's state lives (`tiers`: a device slot or host memory), the stores below
(`stores`, `redis_store`, chosen by `backends`), the one thread that talks to a store (`worker`), what a
command reads from the store first (`leases`), listings (`listing`) and the commands the engine exposes as
`engine.sessions` (`service`)."""
