"""Converted bytes and manifests equal those recorded from the code before the house's refactoring
(tests/layout_digests.json; how they were made: tests/layout_digests.py's docstring). Every case of
layout_digests.cases(): each fixture, both targets, tp 1/2/8, EP, DP-attention, both profiles, both MLA formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import layout_digests as LD

RECORDED = Path(__file__).with_name("layout_digests.json")


@pytest.fixture(scope="module")
def recorded() -> dict:
    data = json.loads(RECORDED.read_text())
    if data["versions"] != LD.versions():
        pytest.skip(f"the digests were recorded with {data['versions']}, this environment has {LD.versions()}: "
                    "the fixtures' bytes depend on them (re-record on the code before a refactoring)")
    return data["cases"]


def test_every_case_recorded(recorded):
    assert sorted(recorded) == sorted(f"{s}/{t}/{m}" for s, t, m in LD.cases())


def test_converted_bytes_unchanged(recorded, tmp_path_factory):
    work = tmp_path_factory.mktemp("digests")
    got = LD.compute(work)
    diff = {k: (recorded[k], got.get(k)) for k in recorded if got.get(k) != recorded[k]}
    assert not diff, "\n".join(
        f"{k}: " + (", ".join(sorted(f for f in set(a) | set(b or {}) if (a.get(f) != (b or {}).get(f))))
                    if isinstance(a, dict) else "")
        for k, (a, b) in list(diff.items())[:20])
