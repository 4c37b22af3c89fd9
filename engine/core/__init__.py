"""The engine's core: a request's state, the scheduler (policy, no arrays), the loop (one thread
per model: schedule → run → update), the runners (the only code that calls the model), sampling
and speculative decoding; `batched.py` and `simple.py` are the two engines built on the loop."""
