"""``python -m phalanx run -n 4 train.py``: the same command line as the ``phalanx`` script."""

from phalanx.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
