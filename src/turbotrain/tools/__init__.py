"""L4 tools: the memory tools (batch-size finder, memory stats).

Layers import only downward (the README's "Architecture"; tests/unit/test_layers.py holds it).
"""
