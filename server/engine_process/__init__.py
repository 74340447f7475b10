"""The engine core in a process of its own (`api_servers` >= 1): the core process (core_main.py) owns the
device, the model, the state pool, the scheduler, the compiled programs and the sessions; the HTTP frontend
talks to it through one connection (channel.py) with a `RemoteEngine` (remote.py) that has the in-process
engine's surface, so the API layer is the same whichever side of the boundary the engine runs on."""
