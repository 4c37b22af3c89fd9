"""OpenAI's Files and Batch APIs: a team's uploads (files.py, file_views.py), and batches of
requests (services.py, views.py) checked up front as their endpoint checks them (lines.py) and
run durably in the flex tier by each web process's runner (runner.py, lifecycle.py)."""
