"""The GLM-5 family (`GlmMoeDsaForCausalLM`, model_type glm_moe_dsa) -> ATOM's post-load layout.

ATOM builds GLM-5, GLM-5.1 and GLM-5.2 as its DeepseekV2ForCausalLM with DeepSeek-V3.2's sparse-MLA
indexer (atom/models/deepseek_v2.py 3435-3445 at ffdf3bb5d; atom-layout-next.md §2), so everything is
planned by deepseek.py and deepseek_v32.py with GLM's dimensions (qk_nope_head_dim 192, v_head_dim 256,
index_n_heads 32, ...). What differs (§2.2, §2.3):

- the vocabulary embedding is a `ReplicatedEmbedding`: whole on every rank at any tp
  (`use_replicated_vocab_embed`: model_type glm_moe_dsa, ATOM_REPLICATE_VOCAB_EMBED=1, untied), while
  `lm_head` stays vocab-parallel. The MTP drafter's too: ATOM builds the drafter from the target's
  config (`Drafter._build_draft_model`, atom/spec_decode/drafter.py 184-187: model_type still
  glm_moe_dsa there, the `deepseek_mtp` rewrite applies to the draft config only);
- IndexShare (GLM-5.2): a layer that `indexer_types` marks "shared" has no Indexer and no indexer
  tensor; the MTP layer always has its own. A config with `index_topk_freq > 1` but no
  `indexer_types` is refused (layout/model.py);
- the fused indexer is also gated by ATOM_ENABLE_GLM_FUSED_INDEXER; both GLM flags are recorded in the
  manifest with V3.2's fusion flag (§6);
- the fp8 release's `modules_to_not_convert` names `indexers_proj`, a quant-config alias of
  `indexer.weights_proj`, which ATOM builds unquantized anyway: no tensor has that name;
- AMD's Quark MXFP4 export (GLM-5.2-MXFP4) quantizes the MoE only (routed and shared experts) and
  excludes attention, so the indexer is bf16 and takes the fused path; an export whose indexer or
  attention is MXFP4 is refused (ATOM then builds the indexer unfused, not modelled here).

--profile vllm-plugin: V3.2's plugin layout (deepseek_v32.py `_PROFILES`). The plugin builds this same
class (atom/plugin/vllm/model_wrapper.py 149), which has no default excludes; the `indexers_proj` mapping is
applied to the target and the MTP drafter alike (472-481). The plugin's config is vLLM's, i.e.
transformers' GlmMoeDsaConfig, which fills `indexer_types` when config.json has none; for the configs
accepted here (no IndexShare key without `indexer_types`, layout/model.py) that is all "full", the layers
ATOM's native server gives an indexer too.
"""

from __future__ import annotations

from typing import Any

from ...errors import UnsupportedError
from ...files.source import SourceCheckpoint
from ..codecs.base import SourceFormat
from ..model import ModelSpec
from ..parallel import Parallel
from ..profile import NamingProfile
from .deepseek import GLM_FLAG_DEFAULTS, INDEXER_FLAG_DEFAULTS
from .deepseek_v32 import INDEXER, DeepseekV32Loader

# Modules whose MXFP4 form the GLM indexer path does not model (the indexer, and the attention whose
# quant spec the indexer inherits, atom-layout-next.md §1.2, §1.5).
_BF16_IN_MXFP4 = ("self_attn.q_a_proj", INDEXER + "wq_b", INDEXER + "wk", INDEXER + "weights_proj")


class GlmMoeDsaLoader(DeepseekV32Loader):
    """GlmMoeDsaForCausalLM: DeepSeek-V3.2's layout with a replicated embedding and IndexShare."""

    keys = (("GlmMoeDsaForCausalLM", "glm_moe_dsa"),)
    extra_flags: dict[str, Any] = {**INDEXER_FLAG_DEFAULTS, **GLM_FLAG_DEFAULTS}
    family = "GLM-5"
    formats = ("bf16", "fp8-block", "quark-mxfp4")

    def replicated_embedding(self, spec: ModelSpec) -> bool:
        # use_replicated_vocab_embed (deepseek_v2.py 3108-3139, 3161; drafter deepseek_mtp.py 182-193)
        return GLM_FLAG_DEFAULTS["ATOM_REPLICATE_VOCAB_EMBED"] == 1 and not spec.tie_word_embeddings

    def check_source(self, src: SourceCheckpoint, spec: ModelSpec, fmt: SourceFormat, target: str,
                     par: Parallel, profile: NamingProfile) -> None:
        super().check_source(src, spec, fmt, target, par, profile)
        if fmt.name != "quark-mxfp4":
            return
        layers = [i for i in range(spec.n_layers + spec.n_mtp) if spec.has_indexer_at(i)]
        for i in layers:
            for part in _BF16_IN_MXFP4:
                module = f"model.layers.{i}.{part}"
                codec = fmt.codec_for(module)
                if codec.name != "bf16":
                    raise UnsupportedError(
                        f"{src.path / 'config.json'}: {module} is {codec.name} in the Quark config; atom-convert "
                        f"converts GLM-5 MXFP4 exports that quantize the MoE only (amd/GLM-5.2-MXFP4 excludes "
                        f"*self_attn*, atom-layout-next.md §2.3). An MXFP4 attention or indexer makes ATOM build the "
                        f"indexer's wk apart from weights_proj (deepseek_v2.py 321-347), a layout not modelled here. "
                        f"Export with self_attn excluded")
