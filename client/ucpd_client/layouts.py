"""Placements for common parallel layouts, for trainers: Megatron-style tensor, pipeline and
expert parallelism, ZeRO partitions (``from ucpd_client import layouts as L``).

The helpers are pure UCL and live in ``ucpd.ucl.layouts`` (spec files use them too); this module
names them for the trainer library. The placement classes themselves are ``ucpd_client.placement``.
"""

from ucpd.ucl.layouts import (
    MegatronLayout,
    ParamSpec,
    column_parallel,
    expert,
    expert_index,
    fused_gate_up,
    fused_qkv,
    global_layer_name,
    padded_vocab,
    padded_vocab_size,
    pipeline_layer_offset,
    row_parallel,
    zero3_param,
    zero_buffer,
    zero_partitions,
)

__all__ = [
    "MegatronLayout", "ParamSpec", "column_parallel", "expert", "expert_index", "fused_gate_up", "fused_qkv",
    "global_layer_name", "padded_vocab", "padded_vocab_size", "pipeline_layer_offset", "row_parallel",
    "zero3_param", "zero_buffer", "zero_partitions",
]
