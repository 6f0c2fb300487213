"""`python bench/decode.py [options]` runs `python -m graphar bench decode [options]` from this checkout."""

import _entry

if __name__ == "__main__":
    _entry.run("decode")
