"""The byte-level encodings checkpoints are made of, read and written without executing anything:
safetensors (``safetensors``), torch's zip archives (``zipdir``, ``zipshape``, ``torchzip``,
``torchzip_write``) and pickles (``pickle_scan``, ``pickle_core``, ``pickle_safe``: an allowlisted
unpickler). No checkpoint layout is known here: formats/ say which files a checkpoint has.
"""
