"""`python bench/norm-local.py [options]` runs `python -m graphar bench norm-local [options]` from this checkout."""

import _entry

if __name__ == "__main__":
    _entry.run("norm-local")
