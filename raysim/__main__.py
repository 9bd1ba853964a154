"""python -m raysim: the raysim command (runs the checkout on sys.path, e.g. with PYTHONPATH=$PWD)."""
import sys

from raysim.app.cli import main

if __name__ == "__main__":  # not when a spawned worker process (raysim reproduce --jobs) re-imports this module
    sys.exit(main())
