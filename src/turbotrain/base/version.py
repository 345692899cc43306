"""The package version, in one place (the package root and the environment report read it)."""

__version__ = "0.1.0"
