#!/bin/sh
# The JavaScript clients the suite drives against a live Orchard (the Codex CLI), installed from
# package-lock.json into node_modules/ with the machine's Node.js and npm.
set -e
cd "$(dirname "$0")/.."
if [ -x node_modules/.bin/codex ] && [ node_modules/.package-lock.json -nt package-lock.json ]; then
  exit 0
fi
command -v npm >/dev/null 2>&1 || {
  echo "npm not found: the Codex CLI test needs Node.js 18+ and npm" >&2
  exit 1
}
echo "Installing the Codex CLI from package-lock.json (for its test)..."
npm ci --no-audit --no-fund --loglevel=error
