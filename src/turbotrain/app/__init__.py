"""L5 application: training (run assembly), tracking (own loops), report, doctor, bench, measure,
profile, tune.

Layers import only downward (the README's "Architecture"; tests/unit/test_layers.py holds it).
"""
