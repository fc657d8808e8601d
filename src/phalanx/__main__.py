"""``python -m phalanx run -n 4 train.py``: the same command line as the ``phalanx`` script."""

from phalanx.cli.main import entry

if __name__ == "__main__":
    entry()
