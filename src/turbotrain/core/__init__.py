"""L2 core, what a step runs: the Engine, precision plugins, transforms (compile, activation
checkpointing), the compile guard, the OOM policy, the optimizer, distributed strategies, the assembly.

Layers import only downward (the README's "Architecture"; tests/unit/test_layers.py holds it).
"""
