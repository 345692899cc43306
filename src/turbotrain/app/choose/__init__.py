"""Settings chosen by measurement (``choose.measure``): candidate recipes timed on the run's own
model, the fastest that keeps loss parity and pays back within the run kept, never one slower
than plain eager; the table printed, written to the run directory and cached.

rule: the candidates and the decision (pure); cache: the key and the files; session: measuring
through :mod:`turbotrain.app.measure`; settings: the ``[choose]`` section (``import turbotrain``
registers it, so this package's ``__init__`` imports nothing)."""
