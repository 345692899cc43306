"""L0 foundation: errors, the config, atomic writes, run directories, processes, signals. Imports no
other layer (the README's "Architecture"; tests/unit/test_layers.py holds it).
"""
