#!/usr/bin/env bash
# Installs raysim and everything it needs on a fresh machine: the Python package (editable, with the test extra
# when called with --test), a C compiler, and the Debian package with the Fashion-MNIST idx files (when apt-get is
# available).
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
# a C compiler: portable numerics' vectorised convolutions on a CPU are raysim's fixed-order GEMM, compiled at first
# use (raysim/fixed_gemm.c); without one such a run is refused with one line naming backend.vectorize
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; if [[ "$(id -u)" != "0" ]] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
  ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq gcc >/dev/null) \
    || echo "setup: could not install gcc; backend.vectorize on a CPU in portable numerics needs a C compiler" >&2
fi
python3 -m raysim.fixed_gemm 2>/dev/null || true  # build it now (into ~/.cache/raysim), not in the first run
# the test suite's two-node tuning test runs a throw-away PostgreSQL server (Debian's postgresql)
if [[ "${1:-}" == "--test" ]] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; if [[ "$(id -u)" != "0" ]] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
  ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq postgresql >/dev/null) \
    || echo "setup: could not install postgresql; the two-node tuning test will fail" >&2
fi
