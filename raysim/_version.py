"""raysim's version, in a leaf that imports nothing: the package face (``raysim.__version__``) and the code version a
run records (:mod:`raysim.engine.provenance`) read it here, so nothing below the face imports the face."""
__version__ = "0.1.0"
