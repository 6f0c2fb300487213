"""Print graphar.allreduce.policy's rows for a committed all-reduce report: what to paste into TABLE.

    PYTHONPATH=. python tools/policy_rows.py bench/results/allreduce-h200-ws2.md 9 2

(the report, the GPU's compute capability major, the world size). tests/test_policy.py holds the
committed TABLE equal to what this prints for the H200 report.
"""

from __future__ import annotations

import sys
from pathlib import Path

from graphar.allreduce import policy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package: by path
from winners import policy_rows, winners_from_report


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    winners = winners_from_report(Path(argv[0]).read_text())
    if winners is None:
        print(f"{argv[0]} has no fastest-kernel section: rerun python bench/allreduce.py")
        return 1
    missing = [mode for mode in policy.MODES if not winners.get(mode)]
    if missing:
        print(f"{argv[0]} has no winners for {missing}: rerun the benchmark with the graph and eager modes")
        return 1
    print(f"    ({int(argv[1])}, {int(argv[2])}): {{")
    for mode in policy.MODES:
        rows = ", ".join(f"({'OPEN' if n == policy.OPEN else n}, {a!r})" for n, a in policy_rows(winners[mode]))
        print(f"        {mode!r}: ({rows},),")
    print("    },")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
