"""Byte-level I/O: every file zckpt reads or writes goes through this package (pread storage,
torch-zip read/write, safetensors, the safe unpickler, direct I/O, staged publish). Nothing here knows a
checkpoint format."""
