"""Numeric precision: the plugins (one class each; defining it registers its name), the non-finite
guard and the backend switches. A new precision is one subclass in one file, imported here."""

from . import fp8_choice  # noqa: F401 (fp8's start hook registers itself)
from .core import (  # noqa: F401 (the package's names)
    PRECISIONS,
    BF16Mixed,
    BF16True,
    DeviceCaps,
    FP16Mixed,
    HostNonFiniteGuard,
    MixedPrecision,
    NonFiniteGuard,
    Precision,
    apply_backend_switches,
    build_guard,
    build_precision,
    fallback_mode,
    precision_class,
    register_precision,
    resolve_precision,
)
from .fp8 import FP8  # noqa: F401
