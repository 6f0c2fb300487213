"""What bench/*.py share: each runs `python -m graphar bench NAME` with this checkout's graphar.

The benchmarks live in the package (graphar/benchmarks/); these scripts keep the old paths working.
"""

import sys
from pathlib import Path

# This checkout's graphar first, installed or not; spawned ranks inherit sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(name: str) -> None:
    from graphar.__main__ import main

    sys.exit(main(["bench", name, *sys.argv[1:]]))
