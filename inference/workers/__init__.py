"""Engine workers over the Channels layer on Redis (`ORCHARD_ENGINE=remote`).

`python manage.py runengine` runs an `EngineServer` (server.py): an `EngineWorker` serving the
registry's enabled models, chat and embedding (or those named by `--models`; placement.py),
following registry changes, taking requests and calls on its own channel, sending their events
back in batches (outbox.py) and heart-beating what it serves to Redis (beats.py). Web processes
use `RemoteEngineClient` (client.py), the same `EngineClient` the in-process engine implements:
it routes each request to the live worker with the least load (fleet.py), renders prompts itself
(the tokenizer only, no round trip; calls.py), tokenizes and embeds on a worker (calls.py),
receives token events in batches on one reply channel per process, and ends a dead worker's
requests and calls with an error (replies.py). Usage rows stay with the web side: nothing that
bills rides on the channel layer (wire.py has the messages).
"""
