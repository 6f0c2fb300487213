"""`python bench/allreduce.py [options]` runs `python -m graphar bench allreduce [options]` from this checkout."""

import _entry

if __name__ == "__main__":
    _entry.run("allreduce")
