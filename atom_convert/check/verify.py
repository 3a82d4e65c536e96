"""`atom-convert verify`: does a converted directory compute what its source computes?

How it works:
1. Integrity: every file's size and digest, every tensor's dtype and shape
   (check.check_files).
2. With a source: every converted tensor decoded back and compared with the
   source tensors it came from (check.check_values): names the tensor that is
   wrong (a permuted head, a double shuffle, a doubled scale, gate/up swapped).
3. With a source: transformers' own DeepseekV2/V3 decoder layers, built and
   loaded from the source one layer at a time (`SourceLayers`: one layer's
   memory, whatever the model's size), and the converted-layout forward
   (reference.ConvertedModel) run on the same random token ids. Each checked
   layer gets the transformers layer's input (so errors do not compound), and
   both stacks are run end to end for the final logits.

Thresholds (why these numbers). Every converted tensor except W_K/W_V decodes
to exactly the value the source holds (layout steps are permutations; fnuz
halves the code and doubles the scale, exact in fp32). So every path that does
not use W_K/W_V must agree with transformers to fp32 summation-order noise
(measured ~3e-7 relative): the kv_b (prefill) attention, each layer's output
(computed from the prefill attention), and the final logits end to end through
the prefill path; bound 1e-4 relative L2 (logits 1e-3, top-1 >= 0.99), which
any layout error (a head, a block scale, a gate/up swap: O(1) errors) misses by
orders of magnitude.
W_K/W_V are re-quantised to fp8 with one scale per tensor (spec §4.1): e4m3
keeps 3 mantissa bits, so a weight moves by up to 2^-4 of itself (about 2^-5.3
rms for uniform rounding), more for values far below the tensor's amax. Through
the attention the output moves by a few percent (measured 0.02-0.03 on random
weights). Bound: rel L2 <= 0.08, cosine >= 0.995 per layer. End to end through
W_K/W_V the noise can flip MoE routing for near-tied tokens, which amplifies it
in a data-dependent way, so that row is reported for information only; the per
layer W_K/W_V rows carry the check.
With --mla-bmm mxfp4 (spec §4.2) W_K/W_V are e2m1 with one e8m0 scale per 32:
one mantissa bit, so a value moves by up to 2^-2 of itself (more below the
block's amax / 6 range); measured on random weights the attention output moves
by 11-12 % from a bf16 kv_b (about 1 % when kv_b is itself MXFP4, the grid
being shared). Bound: rel L2 <= 0.25, cosine >= 0.97.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInputError
from .tensors import CheckReport, _cut, _sets, check_files, check_values
from ..files.dtypes import FP8_BLOCK
from ..layout.codecs.bf16 import FLOAT_DTYPES
from ..layout.codecs.mxfp4 import MXFP4_BLOCK
from ..layout.codecs.requant import mxfp4_exponent
from ..store.manifest import Manifest
from ..store.reader import ConvertedCheckpoint
from ..layout.model import ModelSpec, text_config
from .decode import decode_weight, scale_name, source_value, unpad_moe
from .reference import ConvertedModel, compare
from ..files.source import SourceCheckpoint

THRESHOLDS: dict[str, dict[str, float]] = {
    "attn": {"rel_l2": 0.08, "cosine": 0.995},
    "attn_mxfp4": {"rel_l2": 0.25, "cosine": 0.97},
    "attn_prefill": {"rel_l2": 1e-4, "cosine": 0.999999},
    "layer": {"rel_l2": 1e-4, "cosine": 0.999999},
    "logits": {"rel_l2": 1e-3, "cosine": 0.99999, "top1": 0.99},
    "info": {},
    # --quantize (atom-layout-next.md §4.4, §4.5): per element, |err| / bound <= 1 (bound_ratio), and for
    # MXFP4 from int4 at most 1.6 int4 steps; the forward rows then report the drift (info).
    "requant": {"bound_ratio": 1.0, "int4_steps_mxfp4": 1.6},
}
# Float slack on the per-element bounds (the bounds are exact in real arithmetic; fp32 subtraction is not).
_BOUND_SLACK = 1e-6


@dataclass
class VerifyResult:
    check: CheckReport
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        out = list(self.check.problems)
        for row in self.rows:
            if not row["ok"]:
                out.append(f"{row['what']}: " + ", ".join(f"{k}={row[k]:.4g}" for k in
                                                          ("rel_l2", "cosine", "top1", "bound_ratio", "int4_steps")
                                                          if k in row))
        return out

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "files_checked": self.check.files_checked, "tensors_checked": self.check.tensors_checked,
                "values_checked": self.check.values_checked, "max_mla_rel_err": self.check.max_mla_rel_err,
                "thresholds": THRESHOLDS, "rows": self.rows, "failures": self.failures, "notes": self.check.notes}


def _judge(what: str, kind: str, m: dict[str, float]) -> dict[str, Any]:
    t = THRESHOLDS[kind]
    ok = m["rel_l2"] <= t.get("rel_l2", float("inf")) and m["cosine"] >= t.get("cosine", -1.0) \
        and m.get("top1", 1.0) >= t.get("top1", 0.0)
    return {"what": what, "kind": kind, **m, "ok": ok}


class SourceLayers:
    """transformers' own DeepseekV2/V3 decoder layers, built and loaded one at a time from the
    source, so that the reference needs one layer's memory, whatever the model's size.

    Weights come dequantised in fp32 (fp8 blocks and Quark MXFP4 decoded by `decode.source_value`,
    which the tests hold bit-exact against compressed-tensors and Quark); unquantized tensors stored
    in fp32 or fp16 (the router bias, say) are rounded to bf16 as the runtime holds them (`value`).
    transformers keeps each layer's routed experts fused in memory ([E, 2I, H] gate then up,
    [E, H, I]); the per-expert source tensors are stacked that way here.
    """

    def __init__(self, src: SourceCheckpoint, spec: ModelSpec, device: str):
        import transformers

        transformers.utils.logging.set_verbosity_error()
        # Kimi-K2.5: its text_config, the DeepseekV3Config transformers' Kimi_K25 builds its language model from
        cfg = {k: v for k, v in text_config(src.config).items()
               if k not in ("quantization_config", "auto_map", "architectures")}
        v2 = spec.architecture == "DeepseekV2ForCausalLM"
        cfg["model_type"] = "deepseek_v2" if v2 else "deepseek_v3"  # Kimi-K2 (docs/test-fixtures.md §1)
        self.cfg = (transformers.DeepseekV2Config if v2 else transformers.DeepseekV3Config)(**cfg)
        self.cfg._attn_implementation = "eager"
        if v2:
            from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m

            self._layer_cls, rotary = m.DeepseekV2DecoderLayer, m.DeepseekV2RotaryEmbedding
        else:
            from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

            self._layer_cls, rotary = m.DeepseekV3DecoderLayer, m.DeepseekV3RotaryEmbedding
        self.rotary = rotary(self.cfg).to(device)
        self.src, self.spec, self.device = src, spec, device

    def value(self, name: str) -> torch.Tensor:
        """A text-model tensor by its causal-LM name (the checkpoint's text prefix added: Kimi-K2.5).

        A tensor stored unquantized in fp32 or fp16 (DeepSeek-V3's router bias; norms that some
        fine-tunes save in fp32) is rounded to bf16: the conversion holds every such
        tensor the decoder layers read (norms, router, embedding, lm_head, unquantized weights) in bf16,
        as the runtime's bf16 parameters do after their copy_ (spec §2.1, §2.4, §2.5)."""
        full = self.spec.text_prefix + name
        t = source_value(self.src, full)
        stored = self.src.info(full).dtype if full in self.src else None
        if (stored in FLOAT_DTYPES and stored != torch.bfloat16) or name.endswith("mlp.gate.weight"):
            t = t.to(torch.bfloat16).float()
        return t.to(self.device)

    def layer(self, i: int) -> torch.nn.Module:
        layer = self._layer_cls(self.cfg, i).to(torch.float32)
        p, E = f"model.layers.{i}.", self.spec.E
        sd = {}
        for k in layer.state_dict():
            if k.endswith("experts.gate_up_proj"):
                sd[k] = torch.stack([torch.cat([self.value(f"{p}mlp.experts.{e}.gate_proj.weight"),
                                                self.value(f"{p}mlp.experts.{e}.up_proj.weight")]) for e in range(E)])
            elif k.endswith("experts.down_proj"):
                sd[k] = torch.stack([self.value(f"{p}mlp.experts.{e}.down_proj.weight") for e in range(E)])
            else:
                sd[k] = self.value(p + k)
        layer.load_state_dict(sd, strict=True)
        return layer.to(self.device).eval()


def _requant_bound(exp: torch.Tensor, to: str) -> torch.Tensor:
    """The spec's per-element bound on |requantised - source| for source values `exp` [..., N, K]:
    MXFP4 (§4.4): 2^e, the group's e8m0 scale (Quark's even exponent of the 32 inputs' amax; the
    e2m1 grid's half spacing is at most 2^e, saturation at 6 * 2^e costs at most 2^e); fp8 block
    (§4.5): max(2^-4 |w|, 2^-10 S) with S = the 128x128 block's amax / 448 (e4m3's 3 mantissa bits,
    and its subnormal step 2^-9 S)."""
    if to == "mxfp4":
        e = mxfp4_exponent(exp.reshape(*exp.shape[:-1], -1, MXFP4_BLOCK))
        return torch.exp2(e).repeat_interleave(MXFP4_BLOCK, -1)
    *lead, n, k = exp.shape
    b = FP8_BLOCK
    gn, gk = -(-n // b), -(-k // b)
    pad = exp.new_zeros(*lead, gn * b, gk * b)
    pad[..., :n, :k] = exp.abs()
    s = pad.view(*lead, gn, b, gk, b).amax(dim=(-3, -1)) / float(torch.finfo(torch.float8_e4m3fn).max)
    s = s.repeat_interleave(b, -2)[..., :n, :].repeat_interleave(b, -1)[..., :k]
    return torch.maximum(exp.abs() * 2.0**-4, s * 2.0**-10)


def _int4_steps(src: SourceCheckpoint, name: str) -> torch.Tensor:
    """fp32 int4 scale per element of an int4 source weight (its `weight_scale` per 32 inputs)."""
    base = name.removesuffix(".weight_packed").removesuffix(".weight")
    return src.get(f"{base}.weight_scale").float().repeat_interleave(32, -1)


def _stacked(src: SourceCheckpoint, name: str, weights: list[str], n_got: int, split: Any, slots: list[int],
             n_routed: int, rank: int, value: Any) -> torch.Tensor:
    """What `tensors._expected_experts` stacks, of `value(src, source name)`: the rank's experts,
    each [gate; up] or down, cut on I as the split says."""
    total = n_routed + (1 if any(".shared_experts." in w for w in weights) else 0)
    per = len(weights) // total
    parts = [weights[i * per:(i + 1) * per] for i in slots[:n_got]]
    if name.endswith("w13_weight"):
        return torch.stack([torch.cat([_cut(value(src, n), split, rank, 0) for n in p if "down_proj" not in n])
                            for p in parts])
    return torch.stack([_cut(value(src, [n for n in p if "down_proj" in n][0]), split, rank, 1) for p in parts])


def check_requant(dst: str | Path, source: str | Path) -> list[dict[str, Any]]:
    """--quantize conversions: every re-encoded tensor (a weight with a scale beside it, the MLA operands
    excepted: tensors._check_mla bounds those) decoded and compared with its source through the source's
    own exact dequantisation (int4: q * fp32(scale); bf16: the values), cut for each rank as the
    manifest's split says. One row per (rank, tensor): relative RMS error, max |err|, max |err| / the
    spec's per-element bound (`_requant_bound`), and for an int4 source max |err| in int4 steps."""
    rows: list[dict[str, Any]] = []
    src = SourceCheckpoint(source)
    for root, m in _sets(Path(dst)):
        rq = m.get("requantization")
        if not rq:
            continue
        man = Manifest.read(root)
        par, to = man.parallel, rq["to"]
        n_routed = int(m.get("model", {}).get("n_routed_experts") or 0)
        for rank in range(par.world):
            ck = ConvertedCheckpoint(root, rank)
            for name, e in man.tensors.items():
                if name.endswith("_scale") or scale_name(name) not in man.tensors:
                    continue
                if e.placement == "common" and rank > 0:
                    continue
                weights = [s for s in e.sources if not s.endswith(("_scale_inv", ".weight_scale", ".weight_shape"))]
                int4 = all(w.endswith(".weight_packed") for w in weights)
                got = decode_weight(ck, name)
                steps = None
                if e.split.kind == "experts":
                    got = unpad_moe(got, ck.entry(name), "w13" if name.endswith("w13_weight") else "w2")
                    args = (src, name, weights, got.shape[0], e.split, par.ranks[rank].slots, n_routed, rank)
                    exp = _stacked(*args, source_value)
                    if int4:
                        steps = _stacked(*args, _int4_steps)
                else:
                    exp = torch.cat([_cut(source_value(src, n), e.split, rank) for n in weights])
                    if int4:
                        steps = torch.cat([_cut(_int4_steps(src, n), e.split, rank) for n in weights])
                row: dict[str, Any] = {"what": f"{root.name}/rank{rank} {name} ({rq['from']} -> {to})", "kind": "requant"}
                if got.shape != exp.shape:
                    rows.append({**row, "rel_l2": float("inf"), "cosine": 0.0, "max_abs": float("inf"),
                                 "bound_ratio": float("inf"), "ok": False})
                    continue
                err = (got - exp).abs()
                ratio = float((err / _requant_bound(exp, to)).nan_to_num(0.0, float("inf")).max()) if err.numel() else 0.0
                metrics = compare(got.reshape(1, -1), exp.reshape(1, -1))
                row.update(rel_l2=metrics["rel_l2"], cosine=metrics["cosine"], max_abs=float(err.max()),
                           bound_ratio=ratio)
                ok = ratio <= THRESHOLDS["requant"]["bound_ratio"] + _BOUND_SLACK
                if steps is not None:
                    row["int4_steps"] = float((err / steps).max())
                    if to == "mxfp4":
                        ok = ok and row["int4_steps"] <= THRESHOLDS["requant"]["int4_steps_mxfp4"] + _BOUND_SLACK
                row["ok"] = ok
                rows.append(row)
            ck.close()
    src.close()
    return rows


def _through_loader(dst: Path, device: str) -> list[Any]:
    """Every rank loaded by `load_into` into a bare module tree on `device`, read back as the reference
    forward's ranks: the forward then computes with the tensors the loader placed."""
    from ..serve.load import LoadedRank, load_into, module_tree, rank_view

    tp = rank_view(dst, 0).typed.parallel.world
    ranks = []
    for r in range(tp):
        view = rank_view(dst, r)
        tree = module_tree(view)  # named as the files' profile names them (a vllm-plugin tree: `model.` ...)
        load_into(tree, dst, rank=r, device=device, profile=view.profile)
        ranks.append(LoadedRank(tree, dst, r))
    return ranks


def available_devices() -> list[str]:
    """The torch devices verify can run on here: cpu, and cuda (cuda:0, ...) when torch sees a GPU."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    return out


def check_device(device: str) -> None:
    """Refuse a device torch cannot use on this machine (BadInputError naming --device, the reason and
    the devices available), before any work: torch itself would fail mid-way with an AssertionError."""
    available = ", ".join(available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise BadInputError(f"--device {device!r}: not a torch device; use one of: {available}") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise BadInputError(f"--device {device}: verify runs on cpu or cuda; available on this machine: {available}")
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA or ROCm support" if torch.version.cuda is None and torch.version.hip is None
               else "torch sees no GPU (check the driver and CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")
        raise BadInputError(f"--device {device}: CUDA is not available on this machine: {why} (torch {torch.__version__}); "
                            f"available: {available}; run with --device cpu, or on a machine with a GPU")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise BadInputError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s); "
                            f"available: {available}")


def check_layers(layers: list[int], n_layers: int, source: str | Path) -> None:
    """Refuse layer indices outside the source model's decoder layers (naming each and the range)."""
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers]
    if bad:
        raise BadInputError(f"--layers {','.join(map(str, bad))}: out of range: the model in {source} has {n_layers} "
                            f"decoder layer(s), indices 0-{n_layers - 1}; pick layers in that range, or drop "
                            f"--layers to check every layer")


def verify(dst: str | Path, source: str | Path | None = None, *, layers: list[int] | None = None, tokens: int = 16,
           device: str = "cpu", seed: int = 0, through_loader: bool = False) -> VerifyResult:
    """`through_loader`: the converted side's forward reads the tensors `load_into` placed on `device`
    (every rank), not the files. `layers`, `through_loader` need `source`; a device torch cannot use
    here and a layer the source model lacks are refused (BadInputError) before any check runs."""
    dst = Path(dst)
    check_device(device)
    if source is None and (layers is not None or through_loader):
        raise BadInputError(f"{'--layers' if layers is not None else '--through-loader'} selects what the forward "
                            f"comparison against the source runs, and needs --source (the source checkpoint); "
                            f"add --source SRC, or drop it")
    if source is not None:
        src = SourceCheckpoint(source)
        spec = ModelSpec.from_config(src.config)
        if layers is not None:
            check_layers(layers, spec.n_layers, source)
    report = check_files(dst)
    result = VerifyResult(report)
    if source is None:
        return result
    check_values(dst, source, report)
    result.rows += check_requant(dst, source)
    flagged = report.flagged_sources
    if flagged:
        # NaN/Inf carried into the weights make every later activation NaN on both sides (and a zero
        # or negative scale is no model either): there is nothing for a threshold to judge.
        report.notes.append(f"forward comparison skipped: {len(flagged)} source tensor(s) hold values the "
                            f"conversion's checks flagged ({', '.join(sorted(flagged))}), converted with "
                            f"--allow-nonfinite")
        return result
    conv = ConvertedModel(dst, device=device, ranks=_through_loader(dst, device) if through_loader else None)
    mxfp4_bmm = bool(conv.ranks[0].manifest["layout"]["flags"].get("ATOM_USE_TRITON_MXFP4_BMM"))
    # --quantize: what reads re-encoded weights reports its drift (kind "info"); the per-tensor rows above
    # carry the check (spec §4.4, §4.5). With the routed experts alone re-encoded, each layer's attention
    # and a dense layer's output still equal the source's (every checked layer gets the source's input).
    rq = conv.ranks[0].manifest.get("requantization") or {}
    experts_only = rq.get("modules") == "routed experts"

    def judge(what: str, kind: str, m: dict[str, float], layer: int | None = None) -> dict[str, Any]:
        exact = not rq or (experts_only and (" attention " in what or (layer is not None
                                                                        and not spec.is_moe_layer(layer))))
        return _judge(what, kind, m) if exact else _judge(f"{what} (requantised: drift)", "info", m)

    ids = torch.randint(0, spec.vocab, (tokens,), generator=torch.Generator().manual_seed(seed)).to(device)
    ref = SourceLayers(src, spec, device)
    picked = set(layers if layers is not None else range(spec.n_layers))
    t = ids.shape[0]
    pos = torch.arange(t, device=device)[None]
    mask = torch.full((t, t), float("-inf"), device=device).triu(1)[None, None]
    with torch.no_grad():
        x = ref.value("model.embed_tokens.weight")[ids][None]
        pe = ref.rotary(x, pos)
        for i in range(spec.n_layers):
            layer = ref.layer(i)
            got: dict[str, torch.Tensor] = {}
            hook = layer.self_attn.register_forward_hook(lambda m, a, out: got.__setitem__("attn", out[0].detach()))
            out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
            out = out[0] if isinstance(out, tuple) else out
            hook.remove()
            if i in picked:
                lo = conv.layer(i, x[0])
                result.rows.append(judge(f"layer {i} attention (W_K/W_V)", "attn_mxfp4" if mxfp4_bmm else "attn",
                                          compare(lo.attn, got["attn"][0])))
                result.rows.append(judge(f"layer {i} attention (kv_b prefill)", "attn_prefill",
                                          compare(lo.attn_prefill, got["attn"][0])))
                result.rows.append(judge(f"layer {i} output", "layer", compare(lo.out, out[0]), i))
            x = out
            del layer
        h = x[0].float()
        h = ref.value("model.norm.weight") * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps))
        ref_logits = h @ ref.value("lm_head.weight").T
        result.rows.append(judge("final logits (kv_b prefill path)", "logits", compare(conv.forward(ids), ref_logits, logits=True)))
        result.rows.append(judge("final logits (W_K/W_V path, info)", "info",
                                  compare(conv.forward(ids, absorbed=True), ref_logits, logits=True)))
    return result


def format_table(r: VerifyResult) -> str:
    lines = [f"{'check':<44} {'rel L2':>10} {'cosine':>10} {'max abs':>10} {'top-1':>7}  result"]
    for row in r.rows:
        top1 = f"{row['top1']:.3f}" if "top1" in row else ""
        extra = ""
        if row["kind"] == "requant":  # the per-element bound used (spec §4.4, §4.5), and int4 steps
            extra = f"  (max err / bound {row['bound_ratio']:.3f}" + (
                f", {row['int4_steps']:.3f} int4 steps" if "int4_steps" in row else "") + ")"
        lines.append(f"{row['what']:<44} {row['rel_l2']:>10.3g} {row['cosine']:>10.6f} {row['max_abs']:>10.3g} {top1:>7}  "
                     + ("info" if row["kind"] == "info" else "ok" if row["ok"] else "FAIL") + extra)
    return "\n".join(lines)
