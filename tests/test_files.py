"""The --out folder: checked before a run, locked while one writes, files replaced whole."""
import errno
import os
import threading

import pytest

from mpedu.runtime import LOCK_NAME, OutFolderError, OutLock, atomic_write, prepare_out, why


def test_prepare_out_creates_a_folder_and_refuses_a_file(tmp_path):
    assert prepare_out(tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutFolderError, match="is a file, not a folder"):
        prepare_out(tmp_path / "file")


def test_prepare_out_names_a_file_above_it_and_a_folder_where_a_checkpoint_goes(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutFolderError, match=r"file/sub is inside .*file, which is a file"):
        prepare_out(tmp_path / "file" / "sub")
    for name in ("checkpoint.pt", "model.pt"):      # found before training, not when the first write fails
        (tmp_path / "run" / name).mkdir(parents=True)
        with pytest.raises(OutFolderError, match=f"holds {name} that is not a file"):
            prepare_out(tmp_path / "run")
        (tmp_path / "run" / name).rmdir()
    assert prepare_out(tmp_path / "run").is_dir()


def test_files_written_whole_get_the_umasks_mode_not_a_temp_files_0600(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "f.txt", lambda f: f.write("x"), binary=False)
    finally:
        os.umask(old)
    assert (tmp_path / "f.txt").stat().st_mode & 0o777 == 0o640


def _try_lock_elsewhere(folder) -> str:
    """Take OutLock(folder) on another thread; what happened."""
    said = []

    def attempt():
        try:
            with OutLock(folder, log=said.append):
                said.append("taken")
        except OutFolderError as e:
            said.append(str(e))
    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join()
    return " ".join(said)


def test_a_second_lock_on_the_same_folder_is_refused_naming_the_holder(tmp_path):
    notes = []
    with OutLock(tmp_path, log=notes.append):
        assert f"pid={os.getpid()}" in (tmp_path / LOCK_NAME).read_text()
        said = _try_lock_elsewhere(tmp_path)
        assert f"in use by another mpedu run (pid {os.getpid()}" in said and "taken" not in said
        # the holder's own thread may lock again (the command line, then its train()); the inner
        # release leaves the outer hold in place
        with OutLock(tmp_path, log=notes.append):
            pass
        assert "in use by another mpedu run" in _try_lock_elsewhere(tmp_path)
    assert _try_lock_elsewhere(tmp_path) == "taken"    # released on exit: taken again, with nothing to note
    assert (tmp_path / LOCK_NAME).read_text() == "" and notes == []


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "model.pt"
    atomic_write(path, lambda f: f.write(b"old"))

    def broken(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as error:
        atomic_write(path, broken)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
    assert "disk is full" in why(error.value)
