"""Runtime integrations: ATOM's native server (`atom_native`) and its vLLM plugin (`vllm_plugin`).

Neither ATOM nor vLLM-with-ATOM runs on the machines this package is developed on (they need ROCm),
so these modules follow the loader contract of ../shared/spec/atom-loading.md (§4, §5, §7, §9, §10)
and are tested up to that boundary with module trees and stand-in hooks (tests/test_runtime.py).
"""
