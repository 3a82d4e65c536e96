"""The package version (ground floor: imported by the manifest, fingerprints and the Hub card)."""

__version__ = "0.1.0"
