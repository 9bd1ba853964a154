#!/usr/bin/env bash
# Installs raysim and everything it needs on a fresh machine: the Python package (editable, with the test extra
# when called with --test) and the Debian package with the Fashion-MNIST idx files (when apt-get is available).
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
if [[ "${1:-}" == "--test" ]]; then extra="[test]"; fi
python3 -m pip install -q --disable-pip-version-check -e ".${extra}"
if [[ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; if [[ "$(id -u)" != "0" ]] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
  ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
    || echo "setup: could not install dataset-fashion-mnist; the fashion_mnist dataset needs data.root" >&2
fi
# the test suite's two-node tuning test runs a throw-away PostgreSQL server (Debian's postgresql)
if [[ "${1:-}" == "--test" ]] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; if [[ "$(id -u)" != "0" ]] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
  ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq postgresql >/dev/null) \
    || echo "setup: could not install postgresql; the two-node tuning test will fail" >&2
fi
