"""`python -m zeroinf ...` and `torchrun -m zeroinf ...`: the command line of `zeroinf.cli`."""

from zeroinf.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
