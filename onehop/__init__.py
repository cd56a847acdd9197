"""onehop's process entry points: the `onehop` command line, `onehop serve` (the gateway and an
engine in one process) and the start-up checks of the commands that run an engine.

This is the only package that wires `gateway/` and `engine/` together: the gateway runs
without the engine's server or backends, the engine without the gateway, and neither
imports this package (tests/unit/test_import_structure.py holds them to it).
"""
