"""Checkpoint files on disk: safetensors headers (read and validated once), the lazy source index, the
checkpoint's side files, dtype tables and source value checks. The ground floor above `errors`; imports
nothing else of the package."""
