"""`python bench/ulysses.py [options]` runs `python -m graphar bench ulysses [options]` from this checkout."""

import _entry

if __name__ == "__main__":
    _entry.run("ulysses")
