"""`python bench/pack.py [options]` runs `python -m graphar bench pack [options]` from this checkout."""

import _entry

if __name__ == "__main__":
    _entry.run("pack")
