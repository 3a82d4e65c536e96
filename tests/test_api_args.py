"""The Python API's arguments: a value of the wrong type or range is bad input (BadInputError, naming
the argument and the value) before anything is created or read, never a TypeError from deep inside,
and never taken for another value (a truthy string for True)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from torch import nn

import atom_convert
import atom_trees as T
from atom_convert import BadInputError
from atom_convert.layout.options import ConversionOptions

PRESET = "tiny-deepseek-v2-lite"


@pytest.fixture(scope="module")
def src(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(PRESET, "bf16")


@pytest.fixture(scope="module")
def conv(converted: Callable[..., Path]) -> Path:
    return converted(PRESET, "bf16", "gfx950")


CONVERT_CASES = [
    ({"workers": 1.5}, "workers must be a whole number >= 1, got 1.5"),
    ({"workers": "all"}, "workers must be a whole number >= 1, got 'all'"),
    ({"workers": True}, "workers must be a whole number >= 1, got True"),
    ({"shard_size": "infGB"}, "cannot read size 'infGB'"),
    ({"max_memory": "1e400GB"}, "cannot read size '1e400GB'"),
    ({"profile": ["atom"]}, "unknown runtime profile ['atom']"),
    ({"options": {"tp": 1}}, "options must be a ConversionOptions"),
    ({"force": "no"}, "force must be True or False, got 'no'"),
    ({"allow_nonfinite": "no"}, "allow_nonfinite must be True or False, got 'no'"),
    ({"notify": "x"}, "notify must be a callable"),
]


@pytest.mark.parametrize("kw,says", CONVERT_CASES, ids=[next(iter(k)) + "=" + repr(next(iter(k.values())))
                                                        for k, _ in CONVERT_CASES])
def test_convert_arguments(src: Path, tmp_path: Path, kw: dict[str, Any], says: str) -> None:
    dst = tmp_path / "out" / "dst"
    with pytest.raises(BadInputError) as ei:
        atom_convert.convert(src, dst, **kw)
    assert says in str(ei.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing staged beside DST


def test_force_must_be_a_flag_not_a_truthy_string(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    atom_convert.convert(src, dst)
    before = (dst / "atom_manifest.json").read_bytes()
    with pytest.raises(BadInputError, match="force must be True or False"):
        atom_convert.convert(src, dst, force="no")
    assert (dst / "atom_manifest.json").read_bytes() == before


@pytest.mark.parametrize("which,value", [("src", b"/x"), ("src", 5), ("dst", None), ("dst", b"/tmp/x")])
def test_convert_paths(src: Path, tmp_path: Path, which: str, value: Any) -> None:
    args = {"src": src, "dst": tmp_path / "dst", which: value}
    with pytest.raises(BadInputError, match=f"{which} must be a path"):
        atom_convert.convert(args["src"], args["dst"])


@pytest.mark.parametrize("kw,says", [
    ({"workers": 1.5}, "workers must be a whole number"),
    ({"timeout": "x"}, "timeout must be a number of seconds >= 0"),
    ({"timeout": -1}, "timeout must be a number of seconds >= 0"),
    ({"progress": "yes"}, "progress must be True or False"),
    ({"options": {"tp": 1}}, "options must be a ConversionOptions"),
], ids=["workers", "timeout-str", "timeout-negative", "progress", "options-dict"])
def test_ensure_converted_arguments(src: Path, tmp_path: Path, kw: dict[str, Any], says: str) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(BadInputError, match=says):
        atom_convert.ensure_converted(src, cache, **kw)
    assert not cache.exists() or not any(cache.iterdir())


def test_cache_dir_inside_the_source_is_refused_before_it_is_made(src: Path, tmp_path: Path) -> None:
    mine = tmp_path / "src"
    shutil.copytree(src, mine)
    before = sorted(os.listdir(mine))
    with pytest.raises(BadInputError, match="lies inside the source checkpoint"):
        atom_convert.ensure_converted(mine, mine / "cache")
    assert sorted(os.listdir(mine)) == before


def _model(conv: Path) -> nn.Module:
    return T.build(json.loads((conv / "config.json").read_text()), tp=1, fmt="bf16", meta=True)


@pytest.mark.parametrize("kw,says", [
    ({"rank": "0"}, "rank must be a whole number >= 0, got '0'"),
    ({"rank": True}, "rank must be a whole number >= 0, got True"),
    ({"rank": 1.0}, "rank must be a whole number >= 0, got 1.0"),
    ({"rank": 0, "device": "xyz"}, "device 'xyz' is not a torch device"),
    ({"rank": 0, "device": None}, "device None is not a torch device"),
    ({"rank": 0, "flags": ["ATOM_X"]}, "flags must be a mapping"),
    ({"rank": 0, "parallel": "tp=2"}, "parallel must be a mapping"),
], ids=["rank-str", "rank-bool", "rank-float", "device-name", "device-none", "flags-list", "parallel-str"])
def test_load_into_arguments(conv: Path, kw: dict[str, Any], says: str) -> None:
    with pytest.raises(BadInputError) as ei:
        atom_convert.load_into(_model(conv), conv, **kw)
    assert says in str(ei.value)


def test_load_into_needs_a_module_and_a_path(conv: Path) -> None:
    with pytest.raises(BadInputError, match="model must be a torch.nn.Module"):
        atom_convert.load_into(None, conv, rank=0)  # type: ignore[arg-type]
    with pytest.raises(BadInputError, match="path must be a path"):
        atom_convert.load_into(_model(conv), os.fsencode(conv), rank=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw,says", [({"rank": "0"}, "rank must be a whole number"), ({"rank": None}, "rank must be"),
                                     ({"path": 5}, "path must be a path")], ids=["rank-str", "rank-none", "path-int"])
def test_open_converted_arguments(conv: Path, kw: dict[str, Any], says: str) -> None:
    args = {"path": conv, "rank": 0, **kw}
    with pytest.raises(BadInputError, match=says):
        atom_convert.open_converted(args["path"], rank=args["rank"])


def test_a_numpy_integer_rank_is_a_rank(conv: Path) -> None:
    """A runtime may hand over its rank as a numpy integer: taken as the whole number it is."""
    import numpy as np

    with atom_convert.open_converted(conv, rank=np.int64(0)) as ck:
        assert ck.rank == 0 and type(ck.rank) is int


def test_options_value_is_still_taken_as_given(src: Path, tmp_path: Path) -> None:
    m = atom_convert.convert(src, tmp_path / "dst", options=ConversionOptions(target="gfx942"))
    assert m["target"] == "gfx942"
