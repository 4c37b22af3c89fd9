#!/bin/sh
# The JavaScript the suite runs against a live Orchard (the Codex CLI, and axe-core, which the
# browser tests inject into the pages to check their accessibility), installed from
# package-lock.json into node_modules/ with the machine's Node.js and npm.
set -e
cd "$(dirname "$0")/.."
if [ -x node_modules/.bin/codex ] && [ -f node_modules/axe-core/axe.min.js ] \
  && [ node_modules/.package-lock.json -nt package-lock.json ]; then
  exit 0
fi
command -v npm >/dev/null 2>&1 || {
  echo "npm not found: the Codex CLI and accessibility tests need Node.js 18+ and npm" >&2
  exit 1
}
echo "Installing the Codex CLI and axe-core from package-lock.json (for their tests)..."
npm ci --no-audit --no-fund --loglevel=error
