"""Regenerate the tiny offline VLM data set (``assets/data/vlm_tiny``) from its seed.

    python scripts/make_tiny_vlm_data.py [--out assets/data/vlm_tiny] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mmgrpo.pipelines.vlm.synthetic import write_tiny_dataset

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "assets" / "data" / "vlm_tiny"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default: %(default)s)")
    args = parser.parse_args()
    sizes = write_tiny_dataset(args.out, args.seed)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out}: {sizes['train']} train, {sizes['eval']} eval records, {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
