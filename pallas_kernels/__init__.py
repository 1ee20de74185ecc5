"""Deferred-RoPE paged attention kernels.

The kernels know nothing about models: they take raw queries, a paged K/V pool
whose keys are stored rotated at their own stored angle, and per-logical-page
metadata saying where each page sits and by how much it is shifted.  The
contract: docs/design.md, 'Kernel contract'; the kernels: docs/kernels.md.
"""

from pallas_kernels.lazy_attention import (
    check_kv_pools,
    check_lazy_attention_shapes,
    check_lazy_attention_values,
    lazy_attention,
    plan_lazy_attention,
    resolve_impl,
)
from pallas_kernels.reference import lazy_attention_reference
from pallas_kernels.rope import MAX_ROPE_POSITION, RopeConfig, apply_rope

__all__ = [
    "MAX_ROPE_POSITION",
    "RopeConfig",
    "apply_rope",
    "check_kv_pools",
    "check_lazy_attention_shapes",
    "check_lazy_attention_values",
    "lazy_attention",
    "lazy_attention_reference",
    "plan_lazy_attention",
    "resolve_impl",
]
