"""The engine's core: a request's state, the scheduler (policy, no arrays), the loop (one thread
per model: schedule → run → update) with its output events (`outputs.py`) and figures
(`meter.py`), the runners (`runner.py`: the batch's rows and caches; `forward.py`: the model
calls), sampling and speculative decoding; `batched.py` and `simple.py` are the two engines
built on the loop, `embedding.py` the one an embedding model is served by."""
