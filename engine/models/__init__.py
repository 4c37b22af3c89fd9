"""Model files: loading (mlx-lm with a transformers fallback for the tokenizer), a folder's
config read without loading it, GGUF conversion, and the embedding models' encoder."""
