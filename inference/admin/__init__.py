"""Admin for the model registry (registry.py), pulls from the Hugging Face hub (pulls.py), usage
(usage.py), the requests running now (running.py), stored /v1/responses responses
(responses.py) and batches and their files (batches.py); lists.py holds what their long
changelists share, pickers.py gives accounts' forms the registry's model names.

Usage pages are read-only and built to stay fast at millions of rows: searches are exact matches
on indexed columns, no filter runs a DISTINCT over the rows, the row count is capped, and totals
come from the daily roll-ups.
"""

from inference.admin import (  # noqa: F401  (each registers)
    batches,
    pickers,
    pulls,
    registry,
    responses,
    usage,
)
