"""A stable path for tools that import the loader by its earlier module name (the ATOM oracle in
../shared/atom-oracle does): the loader lives in `atom_convert.serve.load`."""

from .serve.load import (LoadedRank, LoadMismatchError, LoadStats, ManifestMismatchError, RankView,  # noqa: F401
                         TensorRef, in_profile, load_into, manifest_differences, module_tree, rank_view)
