"""Text in and out: chat templates and what callers may pass them, prompt rendering under a time
limit, streaming detokenization with stop strings, gpt-oss's harmony format, and grammars for
structured output. No MLX here: a web process that reaches remote engines renders with it."""
