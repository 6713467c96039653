"""`python -m refimpl ...`: the command line lives in the lab (refimpl/lab/cli.py)."""
from refimpl.lab.cli import _exit, main

if __name__ == "__main__":
    _exit(main())
