"""`python bench/chunking.py [options]` runs `python -m graphar bench chunking [options]` from this checkout."""

import _entry

if __name__ == "__main__":
    _entry.run("chunking")
