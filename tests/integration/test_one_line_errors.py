"""Issue 23 (items 5, 6, 7, 10, 13, 14, 15, 16): failures a user meets end in one line (or fall
back, for checkpoints), never a traceback; what is on disk afterwards is asserted too."""

from __future__ import annotations

import os

import numpy as np
import pytest

from turbotrain.atomic import DiskFullError, UnwritableError, atomic_write, make_dirs
from turbotrain.cli import main
from turbotrain.data.sources import open_tokens

from faults.limits import file_size_limit, tmpfs
from test_train_cli import _args, _one_line_error


# ----------------------------------------------------------------------------- 5: the data cache


def test_an_array_over_the_file_size_limit_is_disk_full_with_no_temp_file(tmp_path):
    """numpy's tofile reported a short write as an OSError without an errno: the writer now
    writes arrays itself, so the limit is seen as what it is."""
    with file_size_limit(50_000), pytest.raises(DiskFullError, match="File too large"):
        atomic_write(tmp_path / "a.bin", np.zeros(100_000, np.uint16))
    assert os.listdir(tmp_path) == []
    atomic_write(tmp_path / "b.bin", np.arange(5, dtype=np.uint16))
    assert np.fromfile(tmp_path / "b.bin", np.uint16).tolist() == [0, 1, 2, 3, 4]


def test_a_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    for folder in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(UnwritableError, match="a file is in the way.*--data.cache_dir"):
            make_dirs(folder, hint="choose another --data.cache_dir")


def test_the_data_cache_full_over_its_limit_read_only_or_a_file_is_one_line(tmp_path, text_file, capsys):
    (tmp_path / "a-file").write_text("x")
    _one_line_error(capsys, main(_args(tmp_path, text_file, f"--data.cache_dir={tmp_path / 'a-file'}")),
                    "a-file", "a file is in the way", "--data.cache_dir")
    _one_line_error(capsys, main(_args(tmp_path, text_file, f"--data.cache_dir={tmp_path / 'a-file' / 'sub'}")),
                    "a-file", "--data.cache_dir")
    with file_size_limit(20_000):  # the corpus is ~40 KB: its cache entry ~80 KB
        code = main(_args(tmp_path, text_file, f"--data.cache_dir={tmp_path / 'limited'}"))
    _one_line_error(capsys, code, "File too large", str(tmp_path / "limited"))
    assert os.listdir(tmp_path / "limited") == []  # no temp file, no half entry
    with tmpfs(tmp_path / "full", "size=40k") as mounted:
        if mounted:
            _one_line_error(capsys, main(_args(tmp_path, text_file, f"--data.cache_dir={tmp_path / 'full'}")),
                            "No space left", "full")
            assert os.listdir(tmp_path / "full") == []
    with tmpfs(tmp_path / "ro", "ro,size=1m") as mounted:
        if mounted:
            _one_line_error(capsys, main(_args(tmp_path, text_file, f"--data.cache_dir={tmp_path / 'ro'}")),
                            "Read-only file system", "--data.cache_dir")
    assert not (tmp_path / "runs" / "t" / "checkpoints").exists()


# ----------------------------------------------------------------------------- 14: --data a device or a FIFO


def test_data_that_is_a_device_or_a_fifo_is_named_for_what_it_is(tmp_path, text_file, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _one_line_error(capsys, main(_args(tmp_path, text_file, "--data", "/dev/zero")), "/dev/zero", "a device",
                    "not a file or a folder")
    _one_line_error(capsys, main(_args(tmp_path, text_file, "--data", str(fifo))), "named pipe (FIFO)")
    err = ""
    with pytest.raises(Exception) as info:
        open_tokens(str(fifo), val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    err = str(info.value)
    assert "permissions" not in err and "Not a directory" not in err
