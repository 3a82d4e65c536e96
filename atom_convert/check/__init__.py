"""Verification: decoding converted tensors back, comparing them with their source, the reference forward through
transformers, `verify` and `inspect`. Imports `serve` and below."""
