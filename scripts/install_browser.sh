#!/bin/sh
# The browser tests (`pytest -m browser`, tests/entrypoints/openai/admin/test_playground.py) drive Debian's Chromium
# through its chromedriver. `make install` runs this: on a fresh machine it installs both with apt; when both are
# there it exits at once, so a ready machine pays nothing.
set -eu

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
# The project's machines run `make` as root; elsewhere apt needs sudo.
if [ "$(id -u)" -eq 0 ]; then
    as_root=""
else
    as_root="sudo"
fi
echo "install needed: chromium and chromium-driver (for the browser tests)"
$as_root apt-get update
$as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver
