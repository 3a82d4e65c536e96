"""The `atom-convert` command line: a thin click layer over the library.

Exit codes: 0 success, 1 internal error only, 2 bad input or usage, 3 a verification that ran and
found problems, 130/143 interrupted (SIGINT/SIGTERM). Set ATOM_CONVERT_DEBUG=1 to see tracebacks.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from types import FrameType
from typing import Any, Iterator, NoReturn

if "torch" not in sys.modules:
    # torch's CPU allocator places tensors of 2 MB and more on transparent huge pages when this is set
    # before torch is imported (it reads it once). A conversion's temporaries are such tensors, made
    # and freed per item: on 4 KB pages each first touch is a fault, which in a VM also costs the
    # host's work (BENCHMARKS.md, eighteenth round: 4-30% less time, a fifth less system time, on
    # the 2-core box). Only the command line sets it, for its own process and its workers; a caller
    # of the library decides for its own process. THP_MEM_ALLOC_ENABLE=0 turns it off.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import click  # noqa: E402

from ..errors import AtomConvertError, BadInputError, Interrupted, VerificationFailedError
from ..layout.profile import PROFILES
from ..files.reading import loads
from ..files.targets import TARGETS


def _examples(*lines: str) -> str:
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


# The smallest --shard-size: below it nearly every tensor gets a file of its own (a typo such as
# `--shard-size 5` for 5GB would write one file per tensor); the tests' tiny checkpoints go down to it.
MIN_SHARD_SIZE = 100 * 1000
# The smallest --max-memory: below it no real model's (layer, rank) item fits, so every worker
# would run alone whatever --workers says (a typo such as `1KB` for 1GB).
MIN_MAX_MEMORY = 64 * 1000**2


class _Size(click.ParamType):
    """A byte size written as 5GB, 500MB, 2GiB or plain bytes, at least `minimum` bytes."""

    name = "SIZE"

    def __init__(self, minimum: int, why: str, example: str):
        self.minimum, self.why, self.example = minimum, why, example

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from ..layout.options import parse_size

        try:
            n = parse_size(value)
        except BadInputError as e:
            self.fail(str(e), param, ctx)
        except (OverflowError, ValueError):  # infGB, nanGB
            self.fail(f"cannot read size {value!r}; write e.g. 5GB, 500MB or 2GiB", param, ctx)
        if n < self.minimum:
            self.fail(f"{value!r} is {n} byte(s), below the minimum of {_human(self.minimum)} ({self.minimum} bytes): "
                      f"{self.why}; give at least that, e.g. {self.example}", param, ctx)
        return n


def _parse_layers(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    """--layers 0,2 -> [0, 2]; anything else is a usage error naming the option."""
    if value is None:
        return None
    parts = [p.strip() for p in value.split(",")]
    if not all(p.isdigit() for p in parts):
        raise click.BadParameter(f"expected comma-separated layer indices like 0,2, got {value!r}; "
                                 f"drop --layers to check every layer", ctx, param)
    return sorted({int(p) for p in parts})


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="atom-convert")
def cli() -> None:
    """Convert DeepSeek V2/V3/R1 and Kimi-K2 checkpoints into the ROCm ATOM runtime's
    post-load weight layout, once, offline; the runtime memory-maps the result."""


@cli.command(epilog=_examples(
    "atom-convert convert ./DeepSeek-V3 ./DeepSeek-V3-atom --target gfx950 --tp 8",
    "atom-convert convert ./Kimi-K2-Instruct ./kimi-mi300 --target gfx942 --tp 8 --shard-size 10GB",
    "atom-convert convert ./DeepSeek-R1 ./r1-atom --tp 8 --workers 16 --max-memory 48GB",
    "atom-convert convert ./DeepSeek-R1 ./r1-atom --no-mtp --dry-run",
    "atom-convert convert ./Kimi-K2-Thinking-MXFP4 ./kimi-mxfp4-atom --target gfx950 --tp 4 --mla-bmm mxfp4",
    "atom-convert convert ./DeepSeek-R1 ./r1-tp8-ep --tp 8 --ep",
    "atom-convert convert ./DeepSeek-R1 ./r1-dpa-ep --tp 8 --dp-attention --ep",
    "atom-convert convert deepseek-ai/DeepSeek-R1 ./r1-atom --tp 8 --hub-cache my-org/DeepSeek-R1-atom-gfx950-tp8",
))
@click.argument("src")
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--target", type=click.Choice(TARGETS), default="gfx950", show_default=True,
              help="GPU: gfx950 (MI355X, fp8 e4m3fn) or gfx942 (MI300X/MI325X, fp8 e4m3fnuz).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel size: one set of shards per rank.")
@click.option("--shard-size", type=_Size(MIN_SHARD_SIZE, "smaller shards put nearly every tensor in a file of its own", "5GB"),
              default="5GB", show_default=True,
              help="Upper bound per shard file, e.g. 5GB, 500MB; at least 100KB.")
@click.option("--dry-run", is_flag=True, help="Print the plan (tensors, dtype, shape, bytes, shard); write nothing.")
@click.option("--force", is_flag=True,
              help="Replace DST if it exists and is an earlier atom-convert output (or empty); never anything else.")
@click.option("--resume", is_flag=True,
              help="Continue the conversion an interrupted run left beside DST (a plain rerun does too, and says "
                   "so); refused if the source or the options changed.")
@click.option("--restart", is_flag=True, help="Discard what an interrupted run left beside DST and start over.")
@click.option("--wait", is_flag=True, help="If another conversion into DST is running, wait for it instead of failing.")
@click.option("--no-mtp", is_flag=True, help="Drop the DeepSeek-V3/R1 MTP layer instead of converting it to DST/mtp/.")
@click.option("--mla-bmm", type=click.Choice(["fp8", "mxfp4"]), default="fp8", show_default=True,
              help="Format of the MLA operands W_K/W_V: fp8 (ATOM default) or mxfp4 (gfx950, the layout of "
                   "ATOM_USE_TRITON_MXFP4_BMM=1).")
@click.option("--quantize", type=click.Choice(["mxfp4", "fp8"]), default=None,
              help="Re-encode while converting: mxfp4 (gfx950; routed experts, amd-quark's MXFP4 rounding) or fp8 "
                   "(DeepSeek fp8 block-128: an int4 source's routed experts, a bf16 source's linears). Required "
                   "for compressed-tensors int4 sources (Kimi-K2-Thinking): ATOM has no int4 MoE.")
@click.option("--ep", is_flag=True, help="Expert parallel (ATOM --enable-expert-parallel): whole experts per rank.")
@click.option("--dp-attention", is_flag=True,
              help="ATOM --enable-dp-attention: attention, dense MLPs, embeddings whole on every rank (stored once).")
@click.option("--shared-experts", type=click.Choice(["fused", "separate"]), default="fused", show_default=True,
              help="The shared expert as a fused expert slot (ATOM_FUSE_SHARED_EXPERT=1) or a separate replicated "
                   "MLP (=0; only with --dp-attention --mori, where ATOM honours it).")
@click.option("--mori", is_flag=True, help="The serving host can import mori (all2all under --dp-attention --ep).")
@click.option("--profile", type=click.Choice(sorted(PROFILES)), default="atom", show_default=True,
              help="Runtime names: atom (native server) or vllm-plugin (ATOM inside vLLM).")
@click.option("--allow-nonfinite", is_flag=True,
              help="Convert even when source values are NaN/Inf, fp8 NaN codes, scales <= 0 or e8m0 NaN (an error "
                   "by default); each such tensor is printed and recorded in the manifest.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="(Layer, rank) items converted in parallel [default: every usable core]. "
                   "The output is byte-identical for every value.")
@click.option("--worker-mode", type=click.Choice(["auto", "process", "thread"]), default="auto", show_default=True,
              help="Run several workers as forked processes (auto, where the platform can fork: the fast way) "
                   "or as threads of one process.")
@click.option("--max-memory", type=_Size(MIN_MAX_MEMORY, "a smaller budget fits no layer of a real model", "16GB"),
              default=None,
              help="Memory budget for the workers' working sets, e.g. 16GB, at least 64MB [default: half of the "
                   "available memory]; workers wait rather than exceed it.")
@click.option("--keep-cached", is_flag=True,
              help="Leave the output in the page cache, for a server started on this host right after (its first "
                   "load then reads memory). By default large blocks are written around it (O_DIRECT): a faster "
                   "conversion that leaves the page cache to others.")
@click.option("--revision", default=None, help="Branch, tag or commit of a Hub repo SRC (or write SRC as org/name@rev).")
@click.option("--hub-cache", default=None, metavar="REPO_ID",
              help="A Hub repo of converted shards (org/name[@rev]): downloaded and checked instead of converting "
                   "when its content key matches this conversion.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def convert(src: str, dst: Path, target: str, tp: int, shard_size: int, dry_run: bool, force: bool, resume: bool,
            restart: bool, wait: bool, no_mtp: bool, mla_bmm: str, quantize: str | None, ep: bool, dp_attention: bool, shared_experts: str,
            mori: bool, profile: str, allow_nonfinite: bool, workers: int | None, worker_mode: str,
            max_memory: int | None, keep_cached: bool, revision: str | None, hub_cache: str | None,
            as_json: bool) -> None:
    """Convert the checkpoint in SRC (a folder, or a Hugging Face repo id org/name[@revision], downloaded
    while converting) into ATOM's layout in DST.

    Shards are staged in .DST.atom-partial/ beside DST and sealed one by one; an interrupted
    conversion (Ctrl-C, SIGTERM, a kill, disk full) is continued by running the same command
    again. One conversion per DST at a time (a lock file beside DST)."""
    from ..engine.convert import convert as run_convert
    from ..engine.planning import plan_summary

    from ..layout.options import ConversionOptions

    if resume and restart:
        raise click.UsageError("--resume and --restart exclude each other; give one of them")
    opts = ConversionOptions(target=target, tp=tp, shard_size=shard_size, mtp=not no_mtp, mla_bmm=mla_bmm, ep=ep,
                             dp_attention=dp_attention, shared_experts=shared_experts, mori=mori, profile=profile,
                             quantize=quantize)
    if dry_run:
        plan = plan_summary(src, options=opts, revision=revision)
        if as_json:
            click.echo(json.dumps(plan, indent=1))
        else:
            _print_plan(plan)
        return
    mode = "resume" if resume else "restart" if restart else "auto"
    with _signals_interrupt():
        try:
            m = run_convert(src, dst, options=opts, force=force, progress=not as_json and sys.stderr.isatty(),
                            resume=mode, wait=wait, notify=lambda line: click.echo(line, err=True), workers=workers,
                            worker_mode=worker_mode, max_memory=max_memory, keep_cached=keep_cached,
                            allow_nonfinite=allow_nonfinite, revision=revision, hub_cache=hub_cache)
        except KeyboardInterrupt as e:
            signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
            text = (e.message if isinstance(e, Interrupted) else "") or "interrupted; nothing was written"
            click.echo(f"error: {text}", err=True)
            raise SystemExit(128 + signum) from None
    bad = m.get("value_checks", {}).get("warnings", [])  # a manifest pulled from a Hub cache may predate them
    if bad:
        click.echo(f"warning: {len(bad)} tensor(s) hold non-finite or invalid values, converted as they are "
                   f"(--allow-nonfinite); recorded in {dst / 'atom_manifest.json'} under value_checks:", err=True)
        for w in bad:
            click.echo(f"  {w['file']}: {w['tensor']}: {w['problem']} at {w['first_index']} ({w['value']})", err=True)
    if as_json:
        click.echo(json.dumps({k: m.get(k) for k in ("target", "tp_size", "parallel", "files", "mtp",
                                                       "conversion_seconds", "conversion", "pulled_from")}, indent=1))
        return
    total = sum(f["bytes"] for f in m["files"].values())
    if m.get("pulled_from"):
        click.echo(f"pulled {m['source']['architecture']} for {m['target']} tp={m['tp_size']} from {m['pulled_from']} "
                   f"(content key {m['conversion']['content_key'][:19]}...): {len(m['files'])} files, {_human(total)}, "
                   f"checked against the manifest -> {dst}")
        return
    click.echo(f"converted {m['source']['architecture']} ({m['source']['model_type']}, {m['source']['quant_format']}) "
               f"for {m['target']} tp={m['tp_size']}: {len(m['tensors'])} tensors per rank, {len(m['files'])} files, "
               f"{_human(total)} in {m['conversion_seconds']:.1f} s -> {dst}")
    if m["mtp"]["status"] == "converted":
        click.echo(f"MTP layer: {m['mtp']['tensors']} tensors in {dst / m['mtp']['path']}")
    rq = m.get("requantization")
    if rq:
        click.echo(f"re-encoded ({rq['modules']}): {rq['from']} -> {rq['to']}; config.json's quantization_config "
                   f"now says {rq['quantization_config']['quant_method']} (atom_manifest.json: requantization)")


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler's timeout, kubectl delete) stops a conversion as Ctrl-C does.

    A signal the parent set to be ignored (nohup, a background job) stays ignored."""
    def on_term(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            previous[sig] = signal.signal(sig, on_term)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def _print_plan(plan: dict[str, Any]) -> None:
    par = plan["parallel"]
    requant = f" re-encoded to {plan['quantize']}" if plan.get("quantize") else ""
    click.echo(f"plan: {plan['architecture']} ({plan['model_type']}, {plan['source_format']}{requant}) -> ATOM layout for "
               f"{plan['target']}, tp={plan['tp']} (ep={par['ep']}, dp_attention={par['dp_attention']}, "
               f"profile {plan['profile']}); nothing is written (--dry-run)")
    for st in plan["sets"]:
        click.echo(f"\n[{st['role']}]")
        click.echo(f"{'rank':>4}  {'tensor':<72} {'dtype':<16} {'shape':<22} {'bytes':>12}  file")
        for r in st["tensors"]:
            click.echo(f"{r['rank']:>4}  {r['name']:<72} {r['dtype']:<16} {str(r['shape']):<22} {r['bytes']:>12}  {r['file']}")
        for s in st["shards"]:
            click.echo(f"shard {s['file']}: rank {s['rank']}, {s['tensors']} tensors, {_human(s['bytes'])}")
    if plan["dropped"]:
        click.echo(f"\ndropped source tensors: {len(plan['dropped'])}")
        for n, why in plan["dropped"].items():
            click.echo(f"  {n}: {why}")
    click.echo(f"\ntotal: {_human(plan['total_bytes'])}")


@cli.command(epilog=_examples("atom-convert inspect ./DeepSeek-V3", "atom-convert inspect ./DeepSeek-V3-atom --json"))
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(path: Path, as_json: bool) -> None:
    """Describe a source checkpoint or a converted directory."""
    from ..check.inspect import describe

    info = describe(path)
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    for k, v in info.items():
        if isinstance(v, dict):
            click.echo(f"{k}:")
            for kk, vv in v.items():
                click.echo(f"  {kk}: {vv}")
        else:
            click.echo(f"{k}: {v}")


@cli.command(epilog=_examples(
    "atom-convert verify ./DeepSeek-V3-atom",
    "atom-convert verify ./DeepSeek-V3-atom --source ./DeepSeek-V3 --layers 0,3 --tokens 32 --device cuda",
    "atom-convert verify ./tiny-atom --source ./tiny --json",
    "atom-convert verify ./DeepSeek-V3-atom --source ./DeepSeek-V3 --device cuda --through-loader",
))
@click.argument("dst", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--source", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The source checkpoint: decode every converted tensor against it and compare forwards.")
@click.option("--layers", default=None, callback=_parse_layers, metavar="N[,N...]",
              help="Comma-separated layer indices like 0,2 for the per-layer forward check (default all); "
                   "with --source.")
@click.option("--tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Random token ids to run (with --source).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the forward comparison runs (with --source); cuda needs a GPU torch can use.")
@click.option("--through-loader", is_flag=True,
              help="Run the converted forward on the tensors atom_convert.load_into places on --device (every rank).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def verify(dst: Path, source: Path | None, layers: list[int] | None, tokens: int, device: str, through_loader: bool,
           as_json: bool) -> None:
    """Check a converted directory: file sizes and digests, tensor names/dtypes/shapes; with
    --source also every tensor's decoded values and a layer-by-layer forward against
    transformers' model of the source. Exits 3 when a check or threshold fails (2: bad usage)."""
    from ..check.verify import check_device, verify as run_verify

    if source is None:
        ctx = click.get_current_context()
        given = [f"--{n.replace('_', '-')}" for n in ("layers", "tokens", "device", "through_loader")
                 if ctx.get_parameter_source(n) not in (None, click.core.ParameterSource.DEFAULT)]
        if given:
            names = ", ".join(given)
            raise click.UsageError(f"{names} {'applies' if len(given) == 1 else 'apply'} only to the forward "
                                   f"comparison against the source, which runs with --source; add --source SRC "
                                   f"(the source checkpoint), or drop {names}")
    check_device(device)
    _report(run_verify(dst, source, layers=layers, tokens=tokens, device=device, through_loader=through_loader),
            as_json, dst)


def _report(r: Any, as_json: bool, dst: Path) -> None:
    from ..check.verify import format_table

    c = r.check
    if as_json:
        click.echo(json.dumps(r.as_dict(), indent=1))
    else:
        click.echo(f"files checked: {c.files_checked}, tensor headers: {c.tensors_checked}, "
                   f"tensors decoded against the source: {c.values_checked}"
                   + (f" (W_K/W_V within {c.max_mla_rel_err:.4f} of amax)" if c.values_checked else ""))
        if r.rows:
            click.echo(format_table(r))
        for n in c.notes:
            click.echo(f"note: {n}")
        for p in r.failures:
            click.echo(f"FAIL {p}")
        click.echo("OK" if r.ok else f"{len(r.failures)} problem(s)")
    if not r.ok:  # the report above lists every problem; exit 3 (not 1: an internal error)
        raise VerificationFailedError(f"verification of {dst} failed: {len(r.failures)} problem(s), listed "
                                      f"{'under failures' if as_json else 'above'}")


@cli.command(epilog=_examples(
    "atom-convert upload ./r1-atom my-org/DeepSeek-R1-atom-gfx950-tp8 --private",
    "atom-convert upload ./r1-atom my-org/DeepSeek-R1-atom-gfx950-tp8 --create-pr",
    "atom-convert upload ./r1-atom my-org/DeepSeek-R1-atom-gfx950-tp8 --dry-run",
))
@click.argument("dst", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo private (when it does not exist yet).")
@click.option("--revision", default=None, help="Branch to upload to (created from main when missing).")
@click.option("--create-pr", is_flag=True, help="Open a pull request against main instead of committing to it.")
@click.option("--base-model", default=None,
              help="base_model in the card's metadata (default: the source repo id the manifest records).")
@click.option("--dry-run", is_flag=True, help="Check the files and print them, their sizes and the model card; "
                                             "send nothing.")
def upload(dst: Path, repo_id: str, private: bool, revision: str | None, create_pr: bool, base_model: str | None,
           dry_run: bool) -> None:
    """Publish the converted directory DST to the Hub repo REPO_ID with a model card (README.md).
    DST's files must match its manifest (sizes and digests). Re-running after an interruption
    skips the files the Hub already holds. HF_TOKEN (or `hf auth login`) gives write access."""
    from ..hub.publish import upload as run_upload

    r = run_upload(dst, repo_id, private=private, revision=revision, create_pr=create_pr, dry_run=dry_run,
                   base_model=base_model)
    if dry_run:
        click.echo(f"would upload {len(r.files)} files ({_human(sum(n for _, n in r.files))}) to {repo_id}:")
        for name, n in r.files:
            click.echo(f"  {n:>14}  {name}")
        click.echo("\nmodel card (README.md):\n")
        click.echo(r.card)
        return
    click.echo(f"uploaded {len(r.files)} files ({_human(sum(n for _, n in r.files))}) to {repo_id}: "
               f"{r.pr_url or r.commit_url}")


DEMO_MARKER = ".atom-convert-demo"  # written first into OUT by `demo`: what it wrote, stage by stage


@cli.command(epilog=_examples("atom-convert demo", "atom-convert demo ./demo-out --target gfx942 --tp 2"))
@click.argument("out", required=False, type=click.Path(path_type=Path), default=Path("atom-convert-demo"))
@click.option("--target", type=click.Choice(TARGETS), default="gfx950", show_default=True)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--preset", default="tiny-deepseek-v3", show_default=True,
              help="A tiny configs/ preset (tiny-*), or the path of a preset .json file.")
def demo(out: Path, target: str, tp: int, preset: str) -> None:
    """Generate a tiny DeepSeek-V3-architecture fp8 checkpoint from configs/, convert it,
    verify it against its source (tensors and a forward pass), and print a summary.
    OUT is created; if it exists it must be empty or an earlier demo's output (marked by
    OUT/.atom-convert-demo), which is replaced: anything else is refused, nothing deleted."""
    import time

    from ..engine.convert import convert as run_convert
    from ..synth import CONFIG_DIR, build_tiny
    from ..check.verify import verify as run_verify

    tiny = sorted(p.stem for p in CONFIG_DIR.glob("tiny-*.json"))
    if preset not in tiny and not (Path(preset).suffix == ".json" and Path(preset).is_file()):
        raise click.BadParameter(f"{preset!r}: the demo builds a tiny checkpoint; choose one of {', '.join(tiny)}, "
                                 f"or give the path of a preset .json file", param_hint="'--preset'")
    _demo_prepare(out)
    _demo_mark(out, "source")
    t0 = time.perf_counter()
    src = build_tiny(preset, out / "source", fmt="fp8", shards=2)
    click.echo(f"1. generated {preset} (fp8 block, 2 shards) in {src} ({time.perf_counter() - t0:.1f} s)")
    _demo_mark(out, "convert")
    t1 = time.perf_counter()
    m = run_convert(src, out / "converted", target, tp=tp)
    _demo_mark(out, "done")
    click.echo(f"2. converted for {target} tp={tp}: {len(m['tensors'])} tensors per rank, {len(m['files'])} files, "
               f"MTP {m['mtp']['status']} ({time.perf_counter() - t1:.1f} s) -> {out / 'converted'}")
    for name in ("model.layers.0.self_attn.fused_qkv_a_proj.weight", "model.layers.1.mlp.experts.w13_weight",
                 "model.layers.1.self_attn.mla_attn.impl.W_K"):
        e = m["tensors"].get(name)
        if e is not None:  # a preset without q_lora_rank has no fused_qkv_a_proj
            click.echo(f"   {name}: {e['dtype']} {e['shape']} shuffled={e['is_shuffled']}")
    click.echo("3. verify against the source (atom-convert verify --source):")
    _report(run_verify(out / "converted", src), False, out / "converted")


def _demo_tree(out: Path) -> set[str]:
    """Every entry under OUT but the marker, relative, folders with a trailing '/'; a symbolic link is
    an entry of its own, never followed (os.walk does not enter a link to a folder)."""
    found: set[str] = set()
    for root, dirs, files in os.walk(out):
        rel = Path(root).relative_to(out)
        for d in dirs:
            link = (Path(root) / d).is_symlink()
            found.add((rel / d).as_posix() + ("" if link else "/"))
        found.update((rel / f).as_posix() for f in files)
    found.discard(DEMO_MARKER)
    return found


def _demo_mark(out: Path, stage: str) -> None:
    """Record in OUT's marker what the demo has written so far and what it writes next (`stage`):
    `_demo_prepare` deletes no entry but those."""
    (out / DEMO_MARKER).write_text(json.dumps({"written_by": "atom-convert demo", "stage": stage,
                                               "entries": sorted(_demo_tree(out))}, indent=1) + "\n")


def _demo_owned(out: Path, found: set[str]) -> list[str]:
    """The entries of `found` that the earlier demo recorded in OUT's marker did NOT write (all of
    them when the marker is not the demo's)."""
    marker = out / DEMO_MARKER
    try:
        rec = loads(marker.read_text()) if marker.is_file() and not marker.is_symlink() else None
    except (OSError, ValueError):
        rec = None
    if not isinstance(rec, dict) or rec.get("written_by") != "atom-convert demo" \
            or not isinstance(rec.get("entries"), list):
        return sorted(found | ({DEMO_MARKER} if os.path.lexists(marker) else set()))
    recorded, stage = set(rec["entries"]), rec.get("stage")

    def written(e: str) -> bool:  # recorded, or what the stage it stopped in writes (an interrupted demo)
        if e in recorded:
            return True
        if stage == "source":
            return e.startswith("source/")
        if stage == "convert":  # DST, and the staging folder and lock convert keeps beside it
            return e.startswith(("converted/", ".converted."))
        return False

    return sorted(e for e in found if not written(e))


def _demo_prepare(out: Path) -> None:
    """OUT ready for the demo: created when missing; kept when empty; emptied when it holds only an
    earlier demo's output; refused (exit 2, nothing deleted) when it is a symbolic link, not a folder,
    or holds anything the demo did not write."""
    def refuse(why: str) -> NoReturn:
        raise click.BadParameter(f"{out} {why}; pick another folder (e.g. atom-convert demo ./demo-out), or remove "
                                 f"it yourself if it is expendable. The demo replaces only an empty folder or its own "
                                 f"earlier output (marked by {DEMO_MARKER})", param_hint="'OUT'")

    if out.is_symlink():
        refuse(f"is a symbolic link (to {os.readlink(out)}), which the demo does not follow")
    if not out.exists():
        out.mkdir(parents=True)
        return
    if not out.is_dir():
        refuse("exists and is not a folder")
    found = _demo_tree(out)
    if not found and not os.path.lexists(out / DEMO_MARKER):
        return
    foreign = _demo_owned(out, found)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        refuse(f"exists and holds what the demo did not write ({shown})")
    for e in sorted(found, key=lambda e: e.rstrip("/").count("/"), reverse=True):  # deepest first
        p = out / e.rstrip("/")
        p.rmdir() if e.endswith("/") else p.unlink()
    (out / DEMO_MARKER).unlink()


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="atom-convert", standalone_mode=False)
    except click.exceptions.Abort as e:
        if isinstance(e.__context__, KeyboardInterrupt):  # click turns Ctrl-C outside `convert` into Abort
            click.echo("error: interrupted", err=True)
            sys.exit(128 + getattr(e.__context__, "signum", signal.SIGINT))
        click.echo("aborted", err=True)
        sys.exit(1)
    except KeyboardInterrupt as e:
        click.echo("error: interrupted", err=True)
        sys.exit(128 + getattr(e, "signum", signal.SIGINT))
    except click.ClickException as e:
        e.show()
        sys.exit(2)  # usage errors
    except AtomConvertError as e:
        if os.environ.get("ATOM_CONVERT_DEBUG"):
            traceback.print_exc()
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001
        traceback.print_exc() if os.environ.get("ATOM_CONVERT_DEBUG") else None
        click.echo(f"internal error: {type(e).__name__}: {e} (set ATOM_CONVERT_DEBUG=1 for a traceback)", err=True)
        sys.exit(1)
    sys.exit(0)


def entry() -> None:
    """The installed `atom-convert` command: `main()`, then `quick_exit` with its exit code."""
    try:
        main()
    except SystemExit as e:
        quick_exit(e.code)


def quick_exit(code: int | str | None = 0) -> NoReturn:
    """End the process as Python's own exit would, less the freeing of every object.

    Why: after a conversion's last line, a process that imported torch takes 0.7-0.8 s on the
    2-core box to tear the interpreter down (torch's operator libraries unregister themselves one
    by one as their objects are freed); a plain `os._exit` ends it in milliseconds. That is 4% of a
    20 s conversion at bench width (BENCHMARKS.md, issue 9, tenth round).
    What still happens, in Python's order: the other non-daemon threads are waited for, the atexit
    handlers run (logging's flush, multiprocessing's, tqdm's), stdout and stderr are flushed. What is
    skipped holds nothing unwritten: every command closes (and `convert` fsyncs) its files before
    it returns. Only the installed command ends this way; `main()` called in a process keeps
    Python's exit.
    """
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"), as Python prints it
        print(code, file=sys.stderr)
        code = 1
    # What the interpreter's own exit does first: run threading's exit hooks (they wake idle
    # ThreadPoolExecutor workers, which would otherwise wait forever) and wait for the non-daemon
    # threads. `threading._shutdown` is that step; a plain join where it is missing.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    else:  # pragma: no cover - not CPython, or not on the main thread
        me = threading.current_thread()
        for t in threading.enumerate():
            if t is not me and not t.daemon:
                t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code & 0xFF)  # as the C exit() Python calls: -1 is 255
