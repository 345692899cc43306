"""Reference models: GPT language model, classifiers, mixture-of-experts GPT; the model families a
run's ``model.arch`` names are registered on import (:mod:`.registry`)."""

from .registry import spec_for

__all__ = ["spec_for"]
