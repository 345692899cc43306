"""Numeric precision: the plugins (one class each; defining it registers its name), the non-finite
guard and the backend switches. ``core`` holds the base class, the built-in 16/32-bit modes and the
guard; ``fp8`` the torchao float8 mode (torchao itself is imported only when an fp8 run starts).
A new precision is one subclass in one file, imported here (or by your own code before use)."""

from . import fp8_choice  # noqa: F401 (fp8's start hook registers itself)
from .core import (
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
from .fp8 import FP8

__all__ = [
    "PRECISIONS",
    "BF16Mixed",
    "BF16True",
    "DeviceCaps",
    "FP16Mixed",
    "FP8",
    "HostNonFiniteGuard",
    "MixedPrecision",
    "NonFiniteGuard",
    "Precision",
    "apply_backend_switches",
    "build_guard",
    "build_precision",
    "fallback_mode",
    "precision_class",
    "register_precision",
    "resolve_precision",
]
