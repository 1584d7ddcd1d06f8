"""Run by ``mmgrpo.demo.launch`` (two gloo processes): ``mmgrpo demo vlm`` shrunk as in tests/support/small_demo.py,
with a one-minute training budget that the test interrupts with Ctrl-C (SIGINT to the launching process), and no
validation check due before the budget ends.

Usage: demo_interrupt_check.py OUT_DIR
"""

import dataclasses
import sys

from small_demo import shrink

from mmgrpo import demo
from mmgrpo.cli import main

demo.DEMOS["vlm"] = dataclasses.replace(shrink("vlm"), eval_every=1000)
sys.exit(main(["demo", "vlm", "--output-dir", sys.argv[1], "--minutes", "1"]))
