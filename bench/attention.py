"""`python bench/attention.py [options]` runs `python -m graphar bench attention [options]` from this checkout."""

import _entry

if __name__ == "__main__":
    _entry.run("attention")
