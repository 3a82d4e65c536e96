"""A stable path for tools that import the manifest by its earlier module name (the ATOM oracle in
../shared/atom-oracle does): the manifest lives in `atom_convert.store.manifest`."""

from .store.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, TensorEntry  # noqa: F401
