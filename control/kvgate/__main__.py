"""``python -m kvgate`` is the ``kvgate`` command."""

from kvgate.cli import main

if __name__ == "__main__":
    main()
