"""python -m raysim: the raysim command (runs the checkout on sys.path, e.g. with PYTHONPATH=$PWD)."""
import sys

from raysim.cli import main

sys.exit(main())
