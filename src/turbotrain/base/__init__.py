"""L0 foundation: errors, the config and its valid values, atomic writes, a run directory's names and lock,
child processes, signals, a user error as one line, units, the version. Imports no other layer.

Layers import only downward (the README's "Architecture"; tests/unit/test_layers.py holds it).
"""
