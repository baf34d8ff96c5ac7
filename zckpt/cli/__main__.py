"""``python -m zckpt.cli``: the ``zckpt`` command line, as the console script runs it (``zckpt.cli.main``)."""

from zckpt.cli import main

if __name__ == "__main__":
    main()
