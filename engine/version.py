"""The engine's version: DeepSpeed's API version it follows, with a local label (``0.19.8+engine``).

It is ``deepspeed.__version__`` under ``engine.run``, equals the version in the ``deepspeed`` distribution
metadata beside the alias (``engine/alias/deepspeed-0.19.8+engine.dist-info``), and is the ``ds_version`` a
``load_checkpoint`` of a native checkpoint reports.
"""

__version__ = "0.19.8+engine"
