#!/bin/sh
# The browser tests drive a real Chromium through Playwright. Debian's chromium package is used
# where it is (or can be installed as root); elsewhere Playwright fetches its own build.
# Usage: ensure_chromium.sh PYTHON
PY=${1:-python3}
for path in /usr/bin/chromium /usr/bin/chromium-browser; do
  [ -x "$path" ] && exit 0
done
if [ "$(uname -s)" = "Linux" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "Installing Debian's chromium (for the browser tests)..."
  (apt-get install -y -qq chromium >/dev/null 2>&1 ||
   (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)) && exit 0
fi
echo "No system Chromium; fetching Playwright's own build..."
exec "$PY" -m playwright install chromium
