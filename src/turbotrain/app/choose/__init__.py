"""Settings chosen by measurement (``choose.measure``, docs/choose.md). rule: the candidates and the
decision (pure); cache: the key and the files; session: measuring through :mod:`turbotrain.app.measure`.
``import turbotrain`` registers the ``[choose]`` section, so this ``__init__`` imports nothing."""
