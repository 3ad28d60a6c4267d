"""torchrun this file instead of `-m mpedu.distributed` to make one rank fail (the failure test):

    torchrun --nproc-per-node 2 tests/failing_rank.py RANK train ...

Rank RANK raises in its first stage's forward; the others run mpedu.distributed as they would. A test
switch kept out of mpedu: the failure is put in here, by replacing StageModule.forward on that rank."""
import os
import sys

from mpedu.distributed import StageModule, main


def _fail(self, x):
    raise RuntimeError(f"failure injected by tests/failing_rank.py in the stage holding {','.join(self.names)}")


if __name__ == "__main__":
    rank = sys.argv.pop(1)
    if os.environ.get("RANK") == rank:
        StageModule.forward = _fail
    sys.exit(main())
