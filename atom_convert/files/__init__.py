"""Checkpoint files on disk: safetensors headers (read and validated once), the lazy source index, the
checkpoint's side files, dtype tables, source value checks, and the one reader of JSON and small state
files (regular files only, bounded, nesting-safe), and the C library calls made through ctypes. The ground floor above `errors`; imports nothing else
of the package."""
