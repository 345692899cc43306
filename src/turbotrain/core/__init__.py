"""L2 core, what a step runs: the Engine, precision, transforms, the optimizer, distributed strategies.
Layers import only downward (the README's "Architecture"; tests/unit/test_layers.py holds it).
"""
