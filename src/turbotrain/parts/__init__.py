"""L1 facts and building blocks: hardware facts (peaks, MFU), the data pipelines, the models and
their specs, a user's workload. Imports only base (tests/unit/test_layers.py holds it)."""
