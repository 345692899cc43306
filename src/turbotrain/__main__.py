"""``python -m turbotrain``: the command line. A rank started by torchrun leaves with
``os._exit`` once everything is written: the interpreter's teardown would destroy
torch.distributed's C++ state (gloo's threads, the store's client) in an order that sometimes
ends the process with "terminate called without an active exception" (SIGABRT), which torchrun
then reports in place of the exit status the command chose (seen in about 1 of 6 runs of a
2-rank resume refused by rank 0; none in 20 with this exit)."""

import os
import sys

from .base.process import exit_after_threads
from .cli import main

code = main()
if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun (its variables)
    exit_after_threads(code)
sys.exit(code)
