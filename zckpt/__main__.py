"""``python -m zckpt``: the ``zckpt`` command line, as the console script runs it (``zckpt.cli.main``).

``zckpt/__init__`` has installed the start-up Ctrl-C guard already (``sys.argv[0] == "-m"`` while runpy
imports the package), so an interrupt while typer and torch load is one line and exit status 130.
"""

from zckpt.cli import main

if __name__ == "__main__":
    main()
