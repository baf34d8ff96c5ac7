"""The ``zckpt`` command line: a thin typer layer over the library (see ``app.py``)."""
