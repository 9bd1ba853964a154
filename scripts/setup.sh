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
