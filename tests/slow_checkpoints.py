"""Run `python -m mpedu` with every checkpoint write slowed down (the kill -9 tests):

    python tests/slow_checkpoints.py SECONDS train ...

Each write sleeps SECONDS between writing the temp file and renaming it, a window wide enough to land a
kill in, to prove a half-written file is never read. A test switch kept out of mpedu: the delay is put
in here, by wrapping mpedu.training.checkpoint's atomic_write."""
import sys
import time

import mpedu.training.checkpoint as checkpoint


def slow_down(seconds: float) -> None:
    """Make every atomic_save of mpedu.training.checkpoint wait `seconds` after its data is written, before the rename."""
    write_file = checkpoint.atomic_write

    def slowly(path, write, **kwargs):
        def write_then_wait(f):
            write(f)
            f.flush()
            time.sleep(seconds)
        return write_file(path, write_then_wait, **kwargs)
    checkpoint.atomic_write = slowly


if __name__ == "__main__":
    slow_down(float(sys.argv.pop(1)))
    from mpedu.cli import main
    sys.exit(main())
