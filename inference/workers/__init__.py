"""Engine workers over the Channels layer on Redis (`ORCHARD_ENGINE=remote`).

`python manage.py runengine` runs an `EngineServer` (server.py): an `EngineWorker` serving the
registry's enabled models (or those named by `--models`), following registry changes, taking
requests on its own channel and heart-beating what it serves to Redis (beats.py). Web processes
use `RemoteEngineClient` (client.py), the same `EngineClient` the in-process engine implements:
it routes each request to the live worker with the least load, renders prompts itself (the
tokenizer only, no round trip), receives token events in batches on one reply channel per
process, and ends a dead worker's requests with an error. Usage rows stay with the web side:
nothing that bills rides on the channel layer (wire.py has the messages).
"""
