"""Data: token sources, random-window loaders with tuned defaults, and device prefetch."""

from .loader import (
    LoaderSettings,
    Position,
    RandomWindowSampler,
    TokenWindows,
    build_loader,
    default_num_workers,
    fixed_batches,
    resolve_loader_settings,
    tune_loader,
)
from .prefetch import DevicePrefetcher
from .sources import TokenSource, TokenSplit, check_vocab, open_tokens, stdlib_files
