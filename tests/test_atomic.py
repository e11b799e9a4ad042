"""Writes that fail part way leave what was there before, and no temporary file."""

import pytest

from ember.atomic import write_atomic, write_text


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "config.toml"
    write_text(path, "old")

    def fails_half_way(handle):
        handle.write(b"new, but cut")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, fails_half_way)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "a.json"
    write_text(path, "first")
    write_text(path, "second")
    assert path.read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
