"""Run by ``mmgrpo.demo.launch`` (two gloo processes): a demo shrunk as in tests/support/small_demo.py, its training
and evaluations split between the processes, the report written by the main one.

Usage: demo_ddp_check.py flow|vlm OUT_DIR
"""

import sys

from small_demo import shrink

from mmgrpo import demo

which, out = sys.argv[1], sys.argv[2]
demo.DEMOS[which] = shrink(which)
with demo.in_repo():
    demo.run_demo(which, out, minutes=0.0)
