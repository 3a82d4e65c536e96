"""Converted files into a live model: `load_into` (one rank's tensors bound to a module tree by the loader
contract) and the byte transfer (CPU mappings, GPU pinned pipeline). Imports `store` and below."""
