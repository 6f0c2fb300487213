"""`python bench/norm.py [options]` runs `python -m graphar bench norm [options]` from this checkout."""

import _entry

if __name__ == "__main__":
    _entry.run("norm")
