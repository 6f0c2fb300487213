"""`python bench/compile.py [options]` runs `python -m graphar bench compile [options]` from this checkout."""

import _entry

if __name__ == "__main__":
    _entry.run("compile")
