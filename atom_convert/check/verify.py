"""`atom-convert verify`: does a converted directory compute what its source computes?

How it works:
1. Integrity: every file's size and sha256, every tensor's dtype and shape
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
from .tensors import CheckReport, check_files, check_values
from ..layout.model import ModelSpec
from .decode import source_value
from .reference import ConvertedModel, compare
from ..files.source import SourceCheckpoint

THRESHOLDS: dict[str, dict[str, float]] = {
    "attn": {"rel_l2": 0.08, "cosine": 0.995},
    "attn_mxfp4": {"rel_l2": 0.25, "cosine": 0.97},
    "attn_prefill": {"rel_l2": 1e-4, "cosine": 0.999999},
    "layer": {"rel_l2": 1e-4, "cosine": 0.999999},
    "logits": {"rel_l2": 1e-3, "cosine": 0.99999, "top1": 0.99},
    "info": {},
}


@dataclass
class VerifyResult:
    check: CheckReport
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        out = list(self.check.problems)
        for row in self.rows:
            if not row["ok"]:
                out.append(f"{row['what']}: " + ", ".join(f"{k}={row[k]:.4g}" for k in ("rel_l2", "cosine", "top1")
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
    which the tests hold bit-exact against compressed-tensors and Quark); the router weight and
    bias are rounded to bf16 as the runtime holds them (spec §2.4, §8.9). transformers keeps each
    layer's routed experts fused in memory ([E, 2I, H] gate then up, [E, H, I]); the per-expert
    source tensors are stacked that way here.
    """

    def __init__(self, src: SourceCheckpoint, spec: ModelSpec, device: str):
        import transformers

        transformers.utils.logging.set_verbosity_error()
        cfg = {k: v for k, v in src.config.items() if k not in ("quantization_config", "auto_map", "architectures")}
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
        t = source_value(self.src, name)
        if name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
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


def _through_loader(dst: Path, device: str) -> list[Any]:
    """Every rank loaded by `load_into` into a bare module tree on `device`, read back as the reference
    forward's ranks: the forward then computes with the tensors the loader placed."""
    from ..serve.load import LoadedRank, load_into, module_tree, rank_view

    tp = rank_view(dst, 0).typed.parallel.world
    ranks = []
    for r in range(tp):
        tree = module_tree(rank_view(dst, r))
        load_into(tree, dst, rank=r, device=device)
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
                result.rows.append(_judge(f"layer {i} attention (W_K/W_V)", "attn_mxfp4" if mxfp4_bmm else "attn",
                                          compare(lo.attn, got["attn"][0])))
                result.rows.append(_judge(f"layer {i} attention (kv_b prefill)", "attn_prefill",
                                          compare(lo.attn_prefill, got["attn"][0])))
                result.rows.append(_judge(f"layer {i} output", "layer", compare(lo.out, out[0])))
            x = out
            del layer
        h = x[0].float()
        h = ref.value("model.norm.weight") * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps))
        ref_logits = h @ ref.value("lm_head.weight").T
        result.rows.append(_judge("final logits (kv_b prefill path)", "logits", compare(conv.forward(ids), ref_logits, logits=True)))
        result.rows.append(_judge("final logits (W_K/W_V path, info)", "info",
                                  compare(conv.forward(ids, absorbed=True), ref_logits, logits=True)))
    return result


def format_table(r: VerifyResult) -> str:
    lines = [f"{'check':<44} {'rel L2':>10} {'cosine':>10} {'max abs':>10} {'top-1':>7}  result"]
    for row in r.rows:
        top1 = f"{row['top1']:.3f}" if "top1" in row else ""
        lines.append(f"{row['what']:<44} {row['rel_l2']:>10.3g} {row['cosine']:>10.6f} {row['max_abs']:>10.3g} {top1:>7}  "
                     + ("info" if row["kind"] == "info" else "ok" if row["ok"] else "FAIL"))
    return "\n".join(lines)
