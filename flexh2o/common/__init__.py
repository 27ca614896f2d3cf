"""Helpers every layer uses: the one error type for bad input, the names flags share, signal
handling, atomic output files, and checks of the Python API's arguments. Imports nothing else of
flexh2o (the bottom layer; docs/design.md, "Layers of the code")."""
