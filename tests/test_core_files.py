"""Files replaced at once (``core/files.py``): the target is the old file or the new one."""
import pytest

from tierflow.core.files import replacing, write_text_atomically


def test_a_written_file_replaces_the_old_one_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "kept.json"
    target.write_text("old")
    write_text_atomically(target, "new", durable=True)
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"]


def test_a_write_that_fails_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    target = tmp_path / "plot.png"
    target.write_text("old")
    with pytest.raises(RuntimeError), replacing(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("the writer failed midway")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]
