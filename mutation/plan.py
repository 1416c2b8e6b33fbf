"""Which tests run against the mutants of each file (the tests that cover it, fast ones first).

Every path is relative to the repository root. A file of the numerical core
that is not listed here is not mutated.
"""

from __future__ import annotations

FUNCTIONAL = ["tests/functional/test_attention.py", "tests/functional/test_masks.py",
              "tests/functional/test_reliability.py", "tests/functional/test_softmax.py",
              "tests/functional/test_defined_outputs.py", "tests/functional/test_properties.py",
              "tests/functional/test_precision.py", "tests/functional/test_dropout_defaults.py",
              "tests/functional/test_nonfinite_paths.py", "tests/functional/test_sdpa_paths.py",
              "tests/functional/test_host_reads.py", "tests/functional/test_compile.py"]  # fmt: skip
CONTRACT = ["tests/modules/test_contract.py", "tests/modules/test_contract_heads.py"]

PLAN: dict[str, list[str]] = {
    "src/multihead/functional/attention.py": FUNCTIONAL,
    "src/multihead/functional/backends.py": FUNCTIONAL,
    "src/multihead/functional/masks.py": FUNCTIONAL,
    "src/multihead/functional/math_backend.py": FUNCTIONAL,
    "src/multihead/functional/nonfinite.py": FUNCTIONAL,
    "src/multihead/functional/request.py": FUNCTIONAL,
    "src/multihead/functional/rope.py": ["tests/functional/test_rope.py", "tests/functional/test_rope_edges.py",
                                         *FUNCTIONAL],
    "src/multihead/functional/sdpa_backend.py": FUNCTIONAL,
    "src/multihead/functional/softmax.py": FUNCTIONAL,
    "src/multihead/functional/sinks.py": ["tests/functional/test_sinks.py"],
    "src/multihead/modules/local.py": ["tests/modules/test_local_attention.py"],
    "src/multihead/modules/graph_cache.py": ["tests/models/test_decode_steps.py"],
    "src/multihead/modules/window_cache.py": ["tests/modules/test_window_cache.py", "tests/models/test_gpt_local_caches.py",
                                              "tests/convert/test_gpt_oss.py"],
    "src/multihead/modules/streaming_cache.py": ["tests/modules/test_local_attention.py", "tests/convert/test_gpt_oss.py"],
    "src/multihead/modules/kinds/mha.py": ["tests/modules/test_attention.py", "tests/modules/test_attention_calls.py",
                                           "tests/modules/test_kv_cache.py", *CONTRACT],
    "src/multihead/modules/kinds/collaborative.py": ["tests/modules/test_collaborative.py", *CONTRACT],
    "src/multihead/modules/kinds/collaborative_compress.py": ["tests/modules/test_collaborative.py"],
    "src/multihead/modules/kinds/dcmha.py": ["tests/modules/test_dcmha.py", *CONTRACT],
    "src/multihead/modules/kinds/dcmha_core.py": ["tests/modules/test_dcmha.py", *CONTRACT],
    "src/multihead/modules/kinds/gated.py": ["tests/modules/test_gated.py", *CONTRACT],
    "src/multihead/modules/kinds/moh.py": ["tests/modules/test_moh.py", *CONTRACT],
    "src/multihead/modules/kinds/moh_paths.py": ["tests/modules/test_moh.py", *CONTRACT],
    "src/multihead/modules/kinds/output_gated.py": ["tests/modules/test_output_gated.py", *CONTRACT],
    "src/multihead/modules/kinds/overlapping.py": ["tests/modules/test_overlapping.py", *CONTRACT],
    "src/multihead/modules/kinds/mla.py": ["tests/modules/test_mla.py", "tests/convert/test_deepseek_mla.py", *CONTRACT],
    "src/multihead/modules/kinds/mla_latent.py": ["tests/modules/test_mla.py", "tests/convert/test_deepseek_mla.py",
                                                  "tests/reference/test_mla.py"],
    "src/multihead/tools/importance.py": ["tests/tools/test_importance.py"],
    "src/multihead/tools/convert_heads.py": ["tests/tools/test_convert_heads.py",
                                             "tests/tools/test_convert_heads_aligned.py", "tests/tools/test_calibration.py"],
    "src/multihead/tools/convert_mla.py": ["tests/tools/test_convert_mla.py"],
    "src/multihead/models/transformer.py": ["tests/models/test_transformer.py", "tests/models/test_kinds_in_models.py"],
    "src/multihead/tools/calibration.py": ["tests/tools/test_calibration.py", "tests/tools/test_convert_heads.py",
                                           "tests/tools/test_convert_heads_aligned.py", "tests/tools/test_convert_mla.py"],
    "src/multihead/tools/prune.py": ["tests/tools/test_prune.py", "tests/tools/test_prune_transformer.py"],
    "src/multihead/train/checkpoint.py": ["tests/train/test_state_integrity.py", "tests/train/test_state_refusals.py",
                                          "tests/train/test_checkpoint_resume.py"],
    "src/multihead/train/loop.py": ["tests/train/test_loop.py", "tests/train/test_checkpoint_resume.py",
                                    "tests/train/test_state_integrity.py"],
}
