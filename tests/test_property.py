"""Property: whatever a mutation does to a valid checkpoint's safetensors headers, index or
config.json, `atom-convert convert` either refuses cleanly (exit 2, a message naming a file
or a config key, nothing left beside DST, SRC unchanged) or produces a directory that passes
verify's integrity check (`check_files`: every file's size and sha256, every tensor's name,
dtype and shape against the manifest). Never an internal error, never a traceback.

Hypothesis draws the mutations from JSON-shaped values (numbers of every sign and size,
strings, lists, objects, null, booleans) and from small perturbations of the real values
(offsets and dims moved by a few units), so both type confusion and near-miss values are
covered. The example count is bounded (`derandomize` keeps CI runs reproducible).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_convert.check.tensors import check_files
from atom_convert.files.source import INDEX_NAME
from hostile_util import listing, run_cli, tree_digest

PRESET = "tiny-deepseek-v3"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# JSON values of every kind, biased towards the ones a config or header holds.
json_leaf = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, -1, 128, 2**31, 2**63, 2**64 + 1]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.5, 1e300, -0.0, 7168.0]),
    st.text(max_size=12), st.sampled_from(["F32", "BF16", "F8_E4M3", "U8", "../x", "/etc/passwd", ""]),
)
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                          max_leaves=6)


def _shard_parts(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, data: bytes) -> None:
    """New inode: the clone's hard link to the session fixture is left alone."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@st.composite
def header_mutation(draw: st.DrawFn) -> tuple[str, Callable[[Path], None]]:
    shard = draw(st.sampled_from(SHARDS))
    how = draw(st.sampled_from(["field", "perturb", "entry", "whole", "metadata", "drop-field"]))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
    value = draw(json_value)
    delta = draw(st.integers(min_value=-3, max_value=3))
    pick = draw(st.integers(min_value=0, max_value=10**6))

    def apply(src: Path) -> None:
        header, data = _shard_parts(src / shard)
        names = sorted(k for k in header if k != "__metadata__")
        t = names[pick % len(names)]
        new: Any = header
        if how == "field":
            header[t][field] = value
        elif how == "drop-field":
            del header[t][field]
        elif how == "perturb":  # a near miss: one number moved by a few units
            v = header[t][field]
            if isinstance(v, list) and v:
                v[pick % len(v)] += delta or 1
            else:
                header[t][field] = delta
        elif how == "entry":
            header[t] = value
        elif how == "metadata":
            header["__metadata__"] = value
        else:
            new = value
        h = json.dumps(new).encode()
        _write(src / shard, struct.pack("<Q", len(h)) + h + data)

    return f"{shard}: {how} {field} of #{pick} -> {value!r} / {delta}", apply


@st.composite
def index_mutation(draw: st.DrawFn) -> tuple[str, Callable[[Path], None]]:
    how = draw(st.sampled_from(["value", "drop", "add", "weight_map", "whole", "swap"]))
    value = draw(json_value)
    pick = draw(st.integers(min_value=0, max_value=10**6))
    key = draw(st.text(max_size=20))

    def apply(src: Path) -> None:
        index = json.loads((src / INDEX_NAME).read_text())
        wm = index["weight_map"]
        names = sorted(wm)
        t = names[pick % len(names)]
        new: Any = index
        if how == "value":
            wm[t] = value
        elif how == "drop":
            del wm[t]
        elif how == "add":
            wm[key] = SHARDS[pick % 2]
        elif how == "swap":
            wm[t] = SHARDS[0] if wm[t] == SHARDS[1] else SHARDS[1]
        elif how == "weight_map":
            index["weight_map"] = value
        else:
            new = value
        _write(src / INDEX_NAME, json.dumps(new).encode())

    return f"index: {how} #{pick} {key!r} -> {value!r}", apply


@st.composite
def config_mutation(draw: st.DrawFn) -> tuple[str, Callable[[Path], None]]:
    how = draw(st.sampled_from(["value", "drop", "perturb", "quant", "whole"]))
    value = draw(json_value)
    delta = draw(st.integers(min_value=-2, max_value=2))
    pick = draw(st.integers(min_value=0, max_value=10**6))

    def apply(src: Path) -> None:
        cfg = json.loads((src / "config.json").read_text())
        keys = sorted(cfg)
        k = keys[pick % len(keys)]
        new: Any = cfg
        if how == "value":
            cfg[k] = value
        elif how == "drop":
            del cfg[k]
        elif how == "perturb":
            ints = [x for x in keys if isinstance(cfg[x], int) and not isinstance(cfg[x], bool)]
            cfg[ints[pick % len(ints)]] += delta
        elif how == "quant":
            q = cfg["quantization_config"]
            q[sorted(q)[pick % len(q)]] = value
        else:
            new = value
        _write(src / "config.json", json.dumps(new).encode())

    return f"config: {how} #{pick} -> {value!r} / {delta}", apply


def _names_something(text: str) -> bool:
    """A refusal names a file of the checkpoint or a config key (each message does both when it can)."""
    return any(s in text for s in ("config.json", INDEX_NAME, *SHARDS, "quantization_config"))


def _check(base: Path, mutation: tuple[str, Callable[[Path], None]]) -> None:
    what, apply = mutation
    with tempfile.TemporaryDirectory(prefix="atom-convert-prop-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(base, src, copy_function=os.link)
        apply(src)
        before = tree_digest(src)
        dst = Path(tmp) / "out" / "dst"
        dst.parent.mkdir()
        r = run_cli(["convert", src, dst])
        assert r.code in (0, 2), f"{what}: exit {r.code}\n{r.text}"
        assert "Traceback" not in r.text and "internal error" not in r.text, f"{what}\n{r.text}"
        assert tree_digest(src) == before, f"{what}: SRC changed"
        if r.code == 2:
            assert _names_something(r.err), f"{what}: the message names no file or key:\n{r.err}"
            assert listing(dst.parent) == set(), f"{what}: left {listing(dst.parent)}"
        else:
            report = check_files(dst)
            assert report.ok, f"{what}: converted, but verify finds {report.problems[:5]}"
            assert listing(dst.parent) == {"dst"}, f"{what}: left {listing(dst.parent)}"


@pytest.fixture(scope="module")
def base(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(PRESET, "fp8")


@SETTINGS
@given(mutation=header_mutation())
def test_header_mutations(base: Path, mutation: tuple[str, Callable[[Path], None]]) -> None:
    _check(base, mutation)


@SETTINGS
@given(mutation=index_mutation())
def test_index_mutations(base: Path, mutation: tuple[str, Callable[[Path], None]]) -> None:
    _check(base, mutation)


@SETTINGS
@given(mutation=config_mutation())
def test_config_mutations(base: Path, mutation: tuple[str, Callable[[Path], None]]) -> None:
    _check(base, mutation)
