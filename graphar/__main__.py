"""`python -m graphar demo`."""

import sys


def main(argv: list[str]) -> int:
    if argv[:1] != ["demo"]:
        print("usage: python -m graphar demo", file=sys.stderr)
        return 2
    from graphar.demo import main as demo

    return demo()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
