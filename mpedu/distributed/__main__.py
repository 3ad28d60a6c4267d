"""`torchrun --nproc-per-node N -m mpedu.distributed {train,check}`: see mpedu.distributed.cli."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
