"""The diagnostic bench tools run on a tiny checkpoint and report what the conversion did (they are
not timed here: speed lives in bench/ and BENCHMARKS.md); bench_convert.py's Kimi-K2.5 source (--family k25)
has the real checkpoint's names and AMD's MXFP4 recipe, the byte count the script checks, and converts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

import atom_convert
from atom_convert.engine import workers
from atom_convert.engine.planning import make_plan
from atom_convert.files.source import SourceCheckpoint

REPO = Path(__file__).resolve().parents[1]
PRESET = "tiny-deepseek-v3"


def _run(*args: str) -> str:
    p = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_moe_scaling_threads_and_processes_produce_the_same_bytes(tiny_checkpoint: Callable[..., Path],
                                                                    tmp_path: Path) -> None:
    src = tiny_checkpoint(PRESET, "fp8")
    plan = make_plan(SourceCheckpoint(src), target="gfx942", tp=2)
    moe = max(([o for o in g.outputs if o.units] for g in plan.main.groups), key=lambda outs: sum(o.nbytes for o in outs))
    want = 2 * sum(o.nbytes for o in moe)  # every rank's w13 and w2
    out = tmp_path / "rows.json"
    _run("bench/moe_scaling.py", str(src), "--tp", "2", "--target", "gfx942", "--workers", "1,3",
         "--mode", "thread,process", "--scratch", str(tmp_path / "scratch"), "--json", str(out))
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["workers"]) for r in rows] == [("thread", 1), ("process", 1), ("thread", 3), ("process", 3)]
    assert all(r["bytes"] == want for r in rows), (want, rows)
    assert not (tmp_path / "scratch").exists()  # its scratch files are removed


def test_trace_convert_records_every_item_and_shard(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_checkpoint(PRESET, "fp8")
    out = tmp_path / "trace.json"
    text = _run("bench/trace_convert.py", str(src), "--tp", "2", "--workers", "3", "--dst", str(tmp_path / "dst"),
                "--shard-size", "64KB", "--json", str(out))
    rec = json.loads(out.read_text())
    plan = make_plan(SourceCheckpoint(src), tp=2)
    expected = workers.items(plan.main.groups, 2, 3)
    if plan.mtp is not None:
        expected += workers.items(plan.mtp.groups, 2, 3)
    assert sorted((i["group"], i["rank"], i["part"] and tuple(i["part"])) for i in rec["items"]) == \
        sorted((i.group.key, i.rank, i.part) for i in expected)
    assert not (tmp_path / "dst").exists()  # the output is removed
    # the shard size reached the conversion: each rank's tensors are cut over several files
    assert rec["shard_size"] == "64KB" and len(rec["hashes"]) > 2 and all(h["end"] >= h["start"] for h in rec["hashes"])
    assert "last item ends at" in text and "cores busy" in text and math.isfinite(rec["end"] - rec["start"])
    # every tensor byte of every rank went through the wrapped pwrite, in the three worker processes
    tensor_bytes = sum(o.nbytes for p in (plan.main, plan.mtp) if p is not None for o in p.outputs()
                       for _ in range(1 if plan.is_common(o) else 2))
    w = rec["waits"]
    assert w["processes"] == 3 and w["pwrite_bytes"] >= tensor_bytes > 0, (w, tensor_bytes)
    assert min(w["queue_s"], w["turn_s"], w["pwrite_s"]) >= 0 and "waits in 3 converting process(es)" in text
    order = rec["order"]  # no schedule beats the perfect balance
    assert order["handed_out"] >= order["balanced"] - 1e-9 and order["longest_first"] >= order["balanced"] - 1e-9
    assert "the hand-out order" in text


def test_trace_convert_list_schedule() -> None:
    """Items go, in order, to the first free worker: [1, 1, 1, 1, 4] on 2 workers ends at 6 as handed out
    (the 4 last, on a worker already at 2), at 4 longest first; one worker ends at the sum."""
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    import trace_convert

    assert trace_convert.list_schedule([1, 1, 1, 1, 4], 2) == 6
    assert trace_convert.list_schedule([4, 1, 1, 1, 1], 2) == 4
    assert trace_convert.list_schedule([1, 2, 3], 1) == 6 and trace_convert.list_schedule([], 3) == 0


def _bench_convert():
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    import bench_convert

    return bench_convert


def test_bench_k25_config_is_kimi_k25_text_width() -> None:
    """bench_convert.py --family k25: a KimiK25ForConditionalGeneration config whose text_config has the Kimi-K2.5
    text width of atom-layout-next.md §0's table, layer 0 dense + layer 1 MoE, no MTP, and a real-width MoonViT
    vision_config (its remote code's KimiK25VisionConfig defaults) with one block; fp8 is refused."""
    import pytest

    b = _bench_convert()
    cfg = b.bench_config(2, 384, 163840, "mxfp4", "k25")
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    t = cfg["text_config"]
    want = {"model_type": "kimi_k2", "hidden_size": 7168, "num_attention_heads": 64, "q_lora_rank": 1536,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "n_routed_experts": 384, "n_shared_experts": 1, "moe_intermediate_size": 2048, "intermediate_size": 18432,
            "vocab_size": 163840, "first_k_dense_replace": 1, "num_hidden_layers": 2, "num_nextn_predict_layers": 0}
    assert {k: t.get(k) for k in want} == want and "quantization_config" not in t
    v = cfg["vision_config"]
    assert (v["vt_hidden_size"], v["vt_intermediate_size"], v["vt_num_attention_heads"], v["vt_num_hidden_layers"],
            v["text_hidden_size"]) == (1152, 4304, 16, 1, 7168)
    assert b.source_dir_name(2, 384, 163840, 0, "mxfp4", "k25") == "src-kimi-k25-mxfp4-L2-E384-V163840-s0"
    with pytest.raises(SystemExit, match="--format mxfp4"):
        b.bench_config(2, 8, 16384, "fp8", "k25")


def _tiny_k25(b, tmp_path: Path, fmt: str) -> tuple[dict, Path]:
    """bench_config's k25 source at k25_fixtures' tiny widths (text and vision), written by synth.build_random."""
    import k25_fixtures as KF
    from atom_convert.synth import build_random

    cfg = b.bench_config(2, KF.TEXT["n_routed_experts"], KF.TEXT["vocab_size"], "mxfp4", "k25")
    cfg["text_config"].update({k: KF.TEXT[k] for k in KF.TF_KEYS if k != "model_type"})
    cfg["vision_config"].update({k: KF.VISION_CONFIG[k] for k in (
        "vt_hidden_size", "vt_intermediate_size", "vt_num_attention_heads", "vt_num_hidden_layers", "mm_hidden_size",
        "init_pos_emb_height", "init_pos_emb_width", "text_hidden_size")})
    gen = {k: v for k, v in cfg.items() if k != "_bench_format"}
    return cfg, build_random(gen, tmp_path / f"src-{fmt}", fmt=fmt, seed=7, shard_bytes=1 << 20)


def _tensors(src: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from safetensors import safe_open

    out = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                out[k] = (s.get_dtype(), tuple(s.get_shape()))
    return out


def test_bench_k25_source_names_bytes_and_conversions(tmp_path: Path) -> None:
    """The k25 source as the benchmark writes it, at tiny width: (1) its names and shapes are those of
    transformers' own Kimi_K25ForConditionalGeneration save renamed to the real checkpoint's names
    (tests/k25_fixtures.py, atom-layout-next.md §3.1, §5.4), vision tower and projector included;
    (2) in MXFP4 every MLP linear (dense, routed and shared experts) is uint8 e2m1 + e8m0 per 32 and every
    other 2-D tensor is 16/32-bit and named in the full-name exclude list (amd/Kimi-K2.5-MXFP4, §3.5);
    (3) expected_source_bytes equals the tensor bytes written; (4) it converts natively (vision dropped)
    and for the vLLM plugin (vision carried) at tp 2, plain and with EP, and verify --source passes."""
    import k25_fixtures as KF
    from atom_convert.check.verify import verify

    b = _bench_convert()
    _, bf16 = _tiny_k25(b, tmp_path, "bf16")
    ref = KF.tf_tensors(0, KF.TEXT)
    got = _tensors(bf16)
    assert {k: s for k, (_, s) in got.items()} == {k: tuple(v.shape) for k, v in ref.items()}

    cfg, src = _tiny_k25(b, tmp_path, "mxfp4")
    got = _tensors(src)
    top = json.loads((src / "config.json").read_text())
    q = top["quantization_config"]
    assert q["quant_method"] == "quark" and "quantization_config" not in top["text_config"]
    excluded = set(q["exclude"])
    for name, (dtype, shape) in got.items():
        module = name.removesuffix(".weight").removesuffix(".weight_scale")
        if name.endswith(".weight_scale"):
            assert dtype == "U8" and got[module + ".weight"][0] == "U8", name
        elif name.startswith(KF.PREFIX) and ".mlp." in name and "proj" in name:
            k = ref[name].shape[1]
            assert (dtype, shape) == ("U8", (ref[name].shape[0], k // 2)), name
            assert got[module + ".weight_scale"] == ("U8", (ref[name].shape[0], k // 32)), name
            assert module not in excluded
        else:
            assert dtype in ("BF16", "F32") and shape == tuple(ref[name].shape), name
            if len(shape) > 1 and not name.endswith("embed_tokens.weight"):
                assert module in excluded, name
    assert b.expected_source_bytes(cfg) == b.safetensors_bytes(src)

    vision = {n for n in got if not n.startswith(KF.PREFIX)}
    for profile, ep in (("atom", False), ("atom", True), ("vllm-plugin", False)):
        dst = tmp_path / f"out-{profile}-{ep}"
        atom_convert.convert(src, dst, target="gfx950", tp=2, profile=profile, ep=ep)
        m = json.loads((dst / "atom_manifest.json").read_text())
        carried = {s for e in m["tensors"].values() for s in e["sources"] if not s.startswith(KF.PREFIX)}
        assert (set(m["dropped"]), carried) == ((vision, set()) if profile == "atom" else (set(), vision))
        r = verify(dst, src)
        assert r.ok, r.failures


def test_convert_stages_switches_off_what_it_names(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """bench/convert_stages.py runs every stage and a --variant, each in its own process: the full run and
    the variant hash their shards, the no-hash run does not; every output, and the recycled stage's scratch
    file, is removed afterwards."""
    src = tiny_checkpoint(PRESET, "fp8")
    out = tmp_path / "stages.json"
    text = _run("bench/convert_stages.py", str(src), "--tp", "2", "--workers", "2", "--runs", "1",
                "--out", str(tmp_path), "--variant", "nice0:atom_convert.engine.procs.WorkerProcesses.nice=0",
                "--json", str(out))
    rec = json.loads(out.read_text())
    by = {r["stage"]: r for r in rec["runs"]}
    assert set(by) == {"full", "hash-pread", "no-hash", "no-checks", "no-write", "no-gc", "recycled", "nice0"}, text
    assert all(r["files"] >= 2 for r in rec["runs"])
    assert by["no-hash"]["digests_void"] and not by["full"]["digests_void"] and not by["nice0"]["digests_void"]
    assert not by["hash-pread"]["digests_void"] and not by["no-gc"]["digests_void"]
    assert not by["recycled"]["digests_void"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stages.json"]  # the outputs and the scratch file are gone


def test_convert_stages_recycles_for_variants_when_asked(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """--recycled-variants: each variant's run recycles the output's memory first, as the recycled stage
    does, and the other stages do not; a --out folder that does not exist yet is made."""
    src = tiny_checkpoint(PRESET, "fp8")
    out = tmp_path / "stages.json"
    text = _run("bench/convert_stages.py", str(src), "--tp", "2", "--workers", "2", "--runs", "1", "--stages", "full",
                "--out", str(tmp_path / "new" / "dir"), "--variant", "nice0:atom_convert.engine.procs.WorkerProcesses.nice=0",
                "--recycled-variants", "--json", str(out))
    by = {r["stage"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(by) == {"full", "nice0"}, text
    assert by["nice0"]["recycled"] and not by["full"]["recycled"] and not by["nice0"]["digests_void"]
    assert list((tmp_path / "new" / "dir").iterdir()) == []


def test_expert_cpu_writes_the_shuffled_experts_and_removes_its_file(tiny_checkpoint: Callable[..., Path],
                                                                     tmp_path: Path) -> None:
    """bench/expert_cpu.py times the per-expert steps on rank 0's cut and checks what it wrote."""
    src = tiny_checkpoint(PRESET, "fp8")
    text = _run("bench/expert_cpu.py", str(src), "--tp", "2", "--experts", "3", "--rounds", "1", "--out", str(tmp_path))
    assert "equal to shuffle16 of [gate; up] and of down" in text, text
    assert "whole, check on the shuffled weight" in text, text
    assert list(tmp_path.iterdir()) == []


def test_write_floor_reports_each_way_and_removes_its_files(tmp_path: Path) -> None:
    """bench/write_floor.py: one record per way and process count, rates and CPU per GB positive,
    nothing left in --out."""
    import json

    ways = ("new", "rewrite", "anon", "shared")
    text = _run("bench/write_floor.py", "--out", str(tmp_path), "--procs", "1,2", "--gb", "0.01", "--rounds", "1",
                "--ways", ",".join(ways))
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert [(r["way"], r["procs"]) for r in rows] == [(w, p) for p in (1, 2) for w in ways]
    assert all(r["gb_per_s"] > 0 and r["cpu_s_per_gb"] >= 0 for r in rows), rows
    assert list(tmp_path.iterdir()) == []


def test_write_floor_shares_files_by_k_with_and_without_turns(tmp_path: Path) -> None:
    """--share K: the shared ways give each K processes one file (4 processes, 2 files), each file whole
    (the script checks its size), with the writer's turns or without; nothing left in --out."""
    import json

    text = _run("bench/write_floor.py", "--out", str(tmp_path), "--procs", "4", "--share", "2", "--gb", "0.02",
                "--rounds", "1", "--ways", "shared,shared-turns")
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert [(r["way"], r["procs"], r["share"]) for r in rows] == [("shared", 4, 2), ("shared-turns", 4, 2)], text
    assert all(r["gb_per_s"] > 0 for r in rows), rows
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("share", [None, 2])
def test_write_floor_makes_pieces_for_pwrite_and_through_a_mapping(tmp_path: Path, share: int | None) -> None:
    """The make- ways: each process's bytes land where it wrote them (the script reads a piece back
    and compares), in a file each or K to a file; nothing left in --out."""
    import json

    text = _run("bench/write_floor.py", "--out", str(tmp_path), "--procs", "2", "--gb", "0.02", "--rounds", "1",
                "--ways", "make-pwrite,make-mapped", *(["--share", str(share)] if share else []))
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert [r["way"] for r in rows] == ["make-pwrite", "make-mapped"], text
    assert all(r["gb_per_s"] > 0 and r.get("share") == share for r in rows), rows
    assert list(tmp_path.iterdir()) == []


def test_convert_then_load_reads_every_ranks_files_after_each_variant(tiny_checkpoint: Callable[..., Path],
                                                                       tmp_path: Path) -> None:
    """bench/convert_then_load.py converts with and without --keep-cached and then reads each rank's
    files (no GPU here, or --read): the same bytes for both variants, and nothing left behind."""
    from atom_convert.serve.load import rank_view

    src = tiny_checkpoint(PRESET, "fp8")
    ref = tmp_path / "ref"
    atom_convert.convert(src, ref, target="gfx942", tp=2)
    want = sum((ref / f).stat().st_size for r in range(2) for f in {t.file for t in rank_view(ref, r).tensors.values()})
    out = tmp_path / "report.json"
    work = tmp_path / "work"
    work.mkdir()
    text = _run("bench/convert_then_load.py", str(src), "--tp", "2", "--target", "gfx942", "--workers", "1",
                "--pairs", "1", "--read", "--no-drop", "--workdir", str(work), "--out", str(out))
    rep = json.loads(out.read_text())
    assert [r["variant"] for r in rep["runs"]] == ["direct", "keep-cached"] and rep["cold"] is False
    assert all(r["load"]["bytes"] == want and r["convert_s"] > 0 for r in rep["runs"]), (want, rep["runs"])
    assert "keep-cached" in text and list(work.iterdir()) == []


def test_ab_packages_runs_each_version_from_its_own_root(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """Each version converts from its own copy of the package, with its constants set; a constant the
    version lacks is refused, and the output folder is gone afterwards."""
    src = tiny_checkpoint(PRESET, "fp8")
    other = tmp_path / "other"
    other.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD", "atom_convert"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(other)], input=archive.stdout, check=True)
    out, dst = tmp_path / "ab.json", tmp_path / "dst"
    text = _run("bench/ab_packages.py", str(src), "--version", f"old={other}", "--version", f"new={REPO}",
                "--set", f"one={REPO}:atom_convert.engine.workers.ITEMS_PER_WORKER=1,shard_size=64KB", "--tp", "2",
                "--workers", "2", "--rounds", "2", "--dst", str(dst), "--json", str(out))
    rec = json.loads(out.read_text())
    assert {k: len(v) for k, v in rec["runs"].items()} == {"old": 2, "new": 2, "one": 2}, text
    same = rec["runs"]["old"] + rec["runs"]["new"]
    assert len({(r["out_bytes"], r["out_files"]) for r in same}) == 1 and same[0]["out_bytes"] > 0
    # the machine's memory before each run, as /proc/meminfo gives it
    assert all(0 < r["mem_free_gb"] and 0 <= r["cached_gb"] for r in same)
    # a module constant and a conversion option: the same tensors cut into more files
    assert rec["versions"]["one"]["set"] == {"atom_convert.engine.workers.ITEMS_PER_WORKER": 1,
                                             "options": {"shard_size": "64KB"}}
    assert all(r["out_files"] > same[0]["out_files"] for r in rec["runs"]["one"])
    assert not dst.exists()
    p = subprocess.run([sys.executable, "bench/ab_packages.py", str(src), "--version", f"a={REPO}", "--set",
                        f"b={REPO}:atom_convert.engine.workers.NO_SUCH=1", "--tp", "2", "--rounds", "1", "--dst",
                        str(dst)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "has no NO_SUCH" in p.stderr, p.stderr
    assert not dst.exists()
