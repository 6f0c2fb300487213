"""`python bench/capture.py [options]` runs `python -m graphar bench capture [options]` from this checkout."""

import _entry

if __name__ == "__main__":
    _entry.run("capture")
