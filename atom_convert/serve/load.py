"""`load_into`: put one rank's converted tensors into a live module tree (spec atom-loading.md §8 A, §10).

How it works:
1. Read the typed manifest and take the rank's view of it (`RankView`: name -> the file this rank reads
   it from (its own or a common one), runtime dtype, shape, is_shuffled; aliases; profile); names are
   renamed when the caller's profile differs from the files' (same bytes, other module paths).
2. Compare what the caller declares (target, layout flags, parallel layout, ATOM revision, profile)
   with the manifest, and refuse naming every difference (§10 item 1).
3. Bind every manifest tensor to a live place: a registered Parameter of the module its name names
   (walked with `named_parameters(remove_duplicate=False)`), or, for W_K/W_K_scale/W_V/W_V_scale, a
   plain attribute of the profile's MLA owner module (§10 items 4, 8). Every unmapped tensor, every
   live Parameter nothing fills and every shape or dtype that differs is collected, and all are
   reported in one error (§10 item 4).
4. Place the bytes (`transfer.py`): on a CPU each tensor is a copy-on-write view of the file's own
   mapping (no copy); on a GPU whole files are read in large chunks on several threads into pinned
   buffers and copied on per-thread streams straight into the destination tensors. Bytes are only
   reinterpreted as the manifest's runtime dtype, never converted (§10 item 5).
5. Install: a Parameter that already lives on the device with the right shape keeps its object (the
   bytes were copied into it); otherwise `module._parameters[name]` is replaced, as ATOM's own IPC
   import does (§5: a meta Parameter cannot be filled in place). Then `is_shuffled = True` on every
   Parameter the manifest marks (§10 item 6), one Parameter object under both names of each alias
   (§10 item 7), the MLA attributes set with `setattr` (§10 item 8). Freeing transients (§10 item 12)
   is left to the caller, once after the model and its drafter are loaded (runtime/common.py).
Nothing here runs any process_weights_after_loading (§10 item 10).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import BadInputError
from ..files.dtypes import ST_DTYPE, dtype_from_name
from ..store.manifest import MANIFEST_NAME, Manifest
from ..layout.postload import registered_shapes
from ..layout.options import check_count, check_path
from ..layout.profile import get_profile
from .transfer import FileRead, TensorSlot, place_cpu, place_cuda, read_header

# Attributes PWAL creates on the MLA owner (spec atom-layout.md §2.7, atom-loading.md §3).
MLA_ATTRS = ("W_K", "W_K_scale", "W_V", "W_V_scale")


class ManifestMismatchError(BadInputError):
    """The converted files assume a runtime other than the one the caller declares (§10 item 1)."""


class LoadMismatchError(BadInputError):
    """The converted tensors and the live module tree do not correspond one to one (§10 item 4)."""


@dataclass(frozen=True)
class TensorRef:
    """One tensor of one rank, as the loader needs it."""

    name: str
    file: str
    dtype: torch.dtype  # the runtime's dtype (e.g. float4_e2m1fn_x2 for U8-stored MXFP4)
    shape: tuple[int, ...]
    is_shuffled: bool
    layout: Mapping[str, Any] = field(default_factory=dict)  # the manifest entry's layout facts
    file_dtype: str | None = None  # the safetensors dtype the file stores it as ("U8" for MXFP4), per the manifest


@dataclass(frozen=True)
class RankView:
    """A rank's tensors and the runtime the files assume: the loader's narrow view of a manifest."""

    path: Path
    rank: int
    tensors: dict[str, TensorRef]  # load order
    aliases: dict[str, str]  # alias name -> tensor name
    target: str
    flags: dict[str, Any]
    profile: str
    typed: Manifest = field(repr=False)  # the whole manifest (parallel layout, raw JSON)

    @property
    def manifest(self) -> dict[str, Any]:
        return self.typed.raw


def _torch_dtype(name: str, where: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise BadInputError(f"{where}: dtype {name!r} is not a torch dtype in this torch ({torch.__version__}); "
                            "use a torch that has it")
    return dt


def rank_view(path: str | os.PathLike[str], rank: int) -> RankView:
    """The rank's view of a converted directory (or of its `mtp/` set): its own and the common files."""
    path = Path(path)
    m = Manifest.read(path)
    world = m.parallel.world
    if not 0 <= rank < world:
        raise BadInputError(f"{path / MANIFEST_NAME}: rank {rank} out of range; the files were converted for "
                            f"{world} ranks")
    tensors = {}
    for name, e in m.tensors.items():
        where = f"{path / MANIFEST_NAME}: tensor {name}"
        tensors[name] = TensorRef(name=name, file=e.file_for(rank), dtype=_torch_dtype(e.runtime_dtype or e.dtype, where),
                                  shape=tuple(e.shape), is_shuffled=e.is_shuffled,
                                  layout=dict(e.layout or {}), file_dtype=ST_DTYPE[dtype_from_name(e.dtype)])
    return RankView(path=path, rank=rank, tensors=tensors, aliases=dict(m.aliases), target=m.target, flags=dict(m.flags),
                    profile=m.profile, typed=m)


def in_profile(view: RankView, profile: str) -> RankView:
    """The view with its names in another runtime profile: the same bytes under other module paths
    (a prefix, the MLA owner; plugin spec §0: plugin mode holds the native bytes). Keys are the live
    names; each TensorRef keeps the name its file uses."""
    if profile == view.profile:
        return view
    src, dst = get_profile(view.profile), get_profile(profile)

    def rename(name: str) -> str:
        native = name[len(src.prefix):] if src.prefix and name.startswith(src.prefix) else name
        mod, attr = _split(native)
        if attr in MLA_ATTRS and (mod == src.mla_owner or mod.endswith("." + src.mla_owner)):
            mod = mod[: len(mod) - len(src.mla_owner)] + dst.mla_owner
        return dst.tensor(f"{mod}.{attr}" if mod else attr)

    return RankView(path=view.path, rank=view.rank, tensors={rename(k): v for k, v in view.tensors.items()},
                    aliases={rename(a): rename(t) for a, t in view.aliases.items()}, target=view.target,
                    flags=view.flags, profile=profile, typed=view.typed)


def manifest_differences(view: RankView, *, target: str | None = None, flags: Mapping[str, Any] | None = None,
                         parallel: Mapping[str, Any] | None = None, atom_revision: str | None = None) -> list[str]:
    """Every field where the files differ from what the caller declares (None: not declared), by the
    manifest's own comparison (`Manifest.differences`: parallel keys tp, dp, ep, dp_attention,
    expert_map, ... as in atom-parallel.md §5)."""
    declared: dict[str, Any] = dict(parallel or {})
    if target is not None:
        declared["target"] = target
    if atom_revision is not None:
        declared["atom_revision"] = atom_revision
    if flags is not None:
        declared["flags"] = dict(flags)
    return view.typed.differences(view.rank, **declared)


@dataclass
class LoadStats:
    """What `load_into` did."""

    bytes: int
    seconds: float
    tensors: int
    files: int
    device: str
    method: str  # "mmap" (CPU) or "pinned-<reader>" (GPU)
    copied_bytes: int = 0  # CPU: bytes copied rather than mapped (misaligned tensors)
    names: frozenset[str] = frozenset()  # live names of the Parameters filled (tensors and aliases)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "seconds": round(self.seconds, 6), "gb_per_s": round(self.gb_per_s, 3),
                "tensors": self.tensors, "files": self.files, "device": self.device, "method": self.method, "copied_bytes": self.copied_bytes}


@dataclass
class _Binding:
    ref: TensorRef
    module: nn.Module
    attr: str
    is_param: bool
    live_name: str
    # A tensor carried unchanged from the checkpoint (Kimi-K2.5's vision tower under vllm-plugin,
    # atom-layout-next.md §3.4) into a live Parameter that has a `weight_loader`: handed whole to it
    # (vLLM's TP cut where the shapes differ), as the plugin's loader does, so the live object keeps
    # its class and attributes (vLLM's parameters carry _input_dim, _output_dim, tp_rank, ...).
    via_loader: bool = False


def _split(name: str) -> tuple[str, str]:
    mod, _, attr = name.rpartition(".")
    return mod, attr


def _live_slots(model: nn.Module) -> dict[str, tuple[int, str]]:
    """Every live Parameter name (`named_parameters(remove_duplicate=False)` order) -> its slot: the
    owning module object and the attribute. A module registered under two parents has one slot under
    both names: ATOM's MLA impl re-registers the attention's q_proj/o_proj/kv_b_proj
    (atom/model_ops/attention_mla.py 427-429), the same Linear objects, not further tensors."""
    slots: dict[str, tuple[int, str]] = {}
    for modname, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                slots[f"{modname}.{attr}" if modname else attr] = (id(module), attr)
    return slots


def _bind(model: nn.Module, view: RankView, mla_owner: str) -> list[_Binding]:
    """Map every manifest tensor to a live place; raise one error listing every problem (§10 item 4)."""
    problems: list[str] = []
    bindings: list[_Binding] = []
    where = view.path / MANIFEST_NAME
    live = dict(model.named_parameters(remove_duplicate=False))
    filled: set[tuple[int, str]] = set()
    for live_name, ref in view.tensors.items():
        modpath, attr = _split(live_name)
        try:
            module = model.get_submodule(modpath) if modpath else model
        except AttributeError:
            problems.append(f"unexpected: {live_name} (in {where}, rank {view.rank} file {ref.file}) has no module "
                            f"{modpath!r} in the live model")
            continue
        if attr in MLA_ATTRS and (modpath == mla_owner or modpath.endswith("." + mla_owner)):
            bindings.append(_Binding(ref, module, attr, is_param=False, live_name=live_name))
            continue
        if attr not in module._parameters or module._parameters[attr] is None:
            problems.append(f"unexpected: {live_name} (in {where}, rank {view.rank} file {ref.file}) has no live "
                            f"Parameter; module {modpath!r} ({type(module).__name__}) registers "
                            f"{sorted(k for k, v in module._parameters.items() if v is not None) or 'none'}")
            continue
        p = module._parameters[attr]
        # A Parameter whose shape ATOM's PWAL changes is registered with its pre-PWAL shape; the files
        # hold the post-PWAL one (e8m0 scales padded or flattened, spec atom-layout.md §3.3.1, §4).
        shapes = {ref.shape, *registered_shapes(ref.shape, ref.layout)}
        if ref.layout.get("carried") and p.dtype == ref.dtype and callable(getattr(p, "weight_loader", None)):
            filled.add((id(module), attr))
            bindings.append(_Binding(ref, module, attr, is_param=True, live_name=live_name, via_loader=True))
            continue
        if tuple(p.shape) not in shapes or p.dtype != ref.dtype:
            before = f" (or {' / '.join(str(list(x)) for x in sorted(shapes - {ref.shape}))} before ATOM's " \
                     "post-load step)" if len(shapes) > 1 else ""
            problems.append(f"wrong shape or dtype: {live_name}: live Parameter {p.dtype} {list(p.shape)}, files "
                            f"{ref.dtype} {list(ref.shape)}{before} (in {where}, rank {view.rank})")
            filled.add((id(module), attr))  # reported once, as a wrong one, not also as missing
            continue
        filled.add((id(module), attr))
        bindings.append(_Binding(ref, module, attr, is_param=True, live_name=live_name))
    for alias, name in view.aliases.items():
        if name not in view.tensors:
            problems.append(f"alias {alias} -> {name}: {name} is not a tensor of {where}")
            continue
        modpath, aattr = _split(alias)
        try:
            amod = model.get_submodule(modpath)
        except AttributeError:
            problems.append(f"unexpected: alias {alias} (in {where}) has no module {modpath!r} in the live model")
            continue
        filled.add((id(amod), aattr))
    for name, slot in _live_slots(model).items():
        if slot not in filled:
            problems.append(f"missing: live Parameter {name} ({live[name].dtype} {list(live[name].shape)}) is not "
                            f"in {where} for rank {view.rank}")
    if problems:
        raise LoadMismatchError(
            f"{view.path}: the converted tensors and the live model differ ({len(problems)} problem(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nBuild the model with the same config.json, flags and parallel layout as the conversion "
              "(atom-convert inspect shows them), or convert again for this model."
        )
    return bindings


def load_into(model: nn.Module, path: str | os.PathLike[str], *, rank: int, device: str | torch.device = "cpu",
              profile: str = "atom", target: str | None = None, flags: Mapping[str, Any] | None = None,
              parallel: Mapping[str, Any] | None = None, atom_revision: str | None = None,
              threads: int | None = None, chunk_bytes: int | None = None, reader: str | None = None) -> LoadStats:
    """Fill `model`'s parameters and post-load attributes from rank `rank` of a converted directory.

    Args:
        model: the live module tree (names as the manifest's profile gives them; Parameters may be on
            meta, on the CPU or on `device`).
        path: a converted directory (or its `mtp/` set for the drafter).
        rank: the tensor-parallel rank whose files to load.
        device: where the tensors go ("cpu": memory-mapped without copying where aligned).
        profile: the runtime naming profile the model follows ("atom").
        target, flags, parallel, atom_revision: what the live runtime is; each one given must equal
            the manifest's, else `ManifestMismatchError` names every difference.
        threads, chunk_bytes, reader: the GPU path's reader threads, chunk size and how chunks reach
            pinned memory (defaults in transfer.py; also ATOM_CONVERT_LOAD_THREADS/_CHUNK/_READER).

    Returns:
        LoadStats: bytes placed, seconds, GB/s, tensors, files.

    Example:
        >>> stats = atom_convert.load_into(model, "DeepSeek-V3-atom", rank=3, device="cuda:3", target="gfx950")
    """
    t0 = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise BadInputError(f"load_into: model must be a torch.nn.Module (the runtime's module tree), got "
                            f"{type(model).__name__}")
    check_path("path", path)
    rank = check_count("rank", rank, minimum=0)
    for name, value in (("flags", flags), ("parallel", parallel)):
        if value is not None and not isinstance(value, Mapping):
            raise BadInputError(f"load_into: {name} must be a mapping of key -> value (or None), got {value!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise BadInputError(f"load_into: device {device!r} is not a torch device ({e}); give e.g. 'cpu' or "
                            f"'cuda:0'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BadInputError(f"load_into: device {device!r}, but this torch has no usable CUDA or ROCm GPU "
                            f"(torch {torch.__version__}); load onto 'cpu', or install the torch build for the GPU")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
        raise BadInputError(f"load_into: device {device!r}, but this process sees {torch.cuda.device_count()} GPU(s); "
                            f"give cuda:0 .. cuda:{torch.cuda.device_count() - 1} (CUDA_VISIBLE_DEVICES / "
                            f"HIP_VISIBLE_DEVICES decide which)")
    prof = get_profile(profile)
    view = rank_view(path, rank)
    diffs = manifest_differences(view, target=target, flags=flags, parallel=parallel, atom_revision=atom_revision)
    unknown = [d for d in diffs if ": not a layout key" in d]
    if unknown:  # a typo in what the caller declares, not a conversion to redo
        raise BadInputError("load_into(parallel=...): " + "; ".join(unknown)
                            + "; fix the key (e.g. parallel={'tp': 8})")
    if diffs:
        raise ManifestMismatchError(
            f"{view.path / MANIFEST_NAME}: the converted files do not match this runtime "
            f"({len(diffs)} difference(s)):\n" + "\n".join(f"  - {d}" for d in diffs)
            + "\nConvert again with these settings (atom-convert convert --target/--tp, or ensure_converted), "
              "or start the runtime with the settings the manifest records."
        )
    view = in_profile(view, prof.name)
    bindings = _bind(model, view, prof.mla_owner)

    # Destinations: an existing Parameter on the device with the same shape, dtype and a dense layout
    # keeps its object and receives the bytes; anything else gets a fresh tensor.
    slots: dict[str, TensorSlot] = {}
    for b in bindings:
        cur = b.module._parameters.get(b.attr) if b.is_param and not b.via_loader else None
        reuse = (cur is not None and cur.device == dev and cur.is_contiguous() and dev.type != "cpu"
                 and tuple(cur.shape) == b.ref.shape and cur.dtype == b.ref.dtype)
        slots[b.ref.name] = TensorSlot(b.ref.name, b.ref.dtype, b.ref.shape, cur.data if reuse else None,
                                       file_dtype=b.ref.file_dtype, manifest=str(view.path / MANIFEST_NAME))
    by_file: dict[str, list[TensorSlot]] = {}
    for b in bindings:
        by_file.setdefault(b.ref.file, []).append(slots[b.ref.name])
    reads = [FileRead(view.path / f, read_header(view.path / f), ss) for f, ss in by_file.items()]
    copied = 0
    if dev.type == "cpu":
        copied, method = place_cpu(reads), "mmap"
    elif dev.type == "cuda":
        method = "pinned-" + place_cuda(reads, dev, threads=threads, chunk_bytes=chunk_bytes, reader=reader)
    else:
        raise BadInputError(f"load_into: device {dev} is not supported; use 'cpu' or 'cuda[:N]'")

    nbytes = 0
    for b in bindings:
        t = slots[b.ref.name].tensor
        assert t is not None
        nbytes += t.numel() * t.element_size()
        if not b.is_param:
            setattr(b.module, b.attr, t)  # W_K/W_V and their 0-dim scales: plain tensors (§2.7)
            continue
        if b.via_loader:
            live_p = b.module._parameters[b.attr]
            if live_p.device.type == "meta":
                live_p.data = torch.empty_like(live_p, device=dev)
            live_p.weight_loader(live_p, t.to(live_p.device))  # type: ignore[attr-defined]
            continue
        cur = b.module._parameters[b.attr]
        if slots[b.ref.name].given is not None and cur is not None:
            p = cur  # the bytes went into the existing object
        else:
            # the live Parameter's requires_grad is kept, as ATOM's loader keeps it (it copies into the
            # live object): vLLM's vision tower builds nn.Conv2d weights that keep requires_grad=True
            keep = cur is not None and cur.requires_grad and (t.is_floating_point() or t.is_complex())
            p = nn.Parameter(t, requires_grad=keep)
            b.module._parameters[b.attr] = p
        if b.ref.is_shuffled:
            p.is_shuffled = True  # type: ignore[attr-defined]  # read by gather_kv_b_proj and aiter (§3)
    for alias, name in view.aliases.items():
        amod, aattr = _split(alias)
        tmod, tattr = _split(name)
        model.get_submodule(amod)._parameters[aattr] = model.get_submodule(tmod)._parameters[tattr]  # one object
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    # gc.collect and empty_cache (§10 item 12) are the caller's, once after everything is loaded
    # (runtime/common.py): a full collection costs 0.1-0.6 s in a process holding torch and transformers.
    return LoadStats(bytes=nbytes, seconds=time.perf_counter() - t0, tensors=len(bindings), files=len(reads),
                     device=str(dev), method=method, copied_bytes=copied,
                     names=frozenset([b.live_name for b in bindings if b.is_param] + list(view.aliases)))


def module_tree(view: RankView) -> nn.Module:
    """A bare module tree with one meta Parameter per manifest tensor (MLA attributes left for
    `load_into` to set) and the aliases registered: what `verify` loads into when no runtime model
    is at hand. Generated from the manifest, so it checks the transfer, not the layout; the tests
    hold the layout against trees written from the spec."""
    root = nn.Module()

    def module(path: str) -> nn.Module:
        m = root
        for part in path.split(".") if path else []:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        return m

    prof = get_profile(view.profile)
    for live_name, ref in view.tensors.items():
        modpath, attr = _split(live_name)
        m = module(modpath)
        if attr in MLA_ATTRS and (modpath == prof.mla_owner or modpath.endswith("." + prof.mla_owner)):
            continue
        m.register_parameter(attr, nn.Parameter(torch.empty(ref.shape, dtype=ref.dtype, device="meta"),
                                                requires_grad=False))
    for alias, name in view.aliases.items():
        amod, aattr = _split(alias)
        tmod, tattr = _split(name)
        module(amod).register_parameter(aattr, module(tmod)._parameters[tattr])
    return root


class LoadedRank:
    """A loaded module tree seen through `ConvertedCheckpoint`'s reading interface (manifest, entry,
    get, `in`), so that the reference forward (reference.py) computes with the tensors `load_into`
    placed rather than with the files."""

    def __init__(self, model: nn.Module, path: str | os.PathLike[str], rank: int):
        from ..store.reader import ConvertedCheckpoint

        self._ck = ConvertedCheckpoint(path, rank)
        self.model, self.rank, self.path = model, rank, Path(path)
        self.manifest = self._ck.manifest
        self.typed = self._ck.typed

    def __contains__(self, name: str) -> bool:
        return name in self._ck

    @property
    def aliases(self) -> dict[str, str]:
        return self._ck.aliases

    def entry(self, name: str) -> dict[str, Any]:
        return self._ck.entry(name)

    def get(self, name: str) -> torch.Tensor:
        modpath, attr = _split(name)
        m = self.model.get_submodule(modpath) if modpath else self.model
        p = m._parameters.get(attr)
        t = p if p is not None else getattr(m, attr)
        return t.detach()
