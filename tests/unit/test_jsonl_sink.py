"""metrics.jsonl's sink: a public flush, and a full disk as one DiskFullError naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turbotrain.base.atomic import DiskFullError
from turbotrain.loop.monitor import JsonlSink


def test_flush_puts_buffered_records_on_disk(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path, flush_every_s=3600)  # nothing flushed by time
    sink.write({"step": 1, "loss": 2.5})
    sink.flush()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 1, "loss": 2.5}]
    sink.close()
    sink.flush()  # closed: nothing to do, no error


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_while_appending_is_one_disk_full_error():
    sink = JsonlSink(Path("/dev/full"), flush_every_s=0)  # every write flushes; /dev/full answers ENOSPC
    with pytest.raises(DiskFullError, match="cannot write /dev/full: No space left on device"):
        sink.write({"step": 1, "loss": 2.5})
    with pytest.raises(DiskFullError):
        sink.close()
