"""Deferred-RoPE paged attention kernels.

The kernels know nothing about models: they take raw queries, a paged K/V pool
whose keys are stored rotated at their own stored angle, and per-logical-page
metadata saying where each page sits and by how much it is shifted.  The
contract: docs/design.md, 'Kernel contract'; the kernels: docs/kernels.md.
"""

from pallas_kernels.lazy_attention import lazy_attention, plan_lazy_attention
from pallas_kernels.reference import lazy_attention_reference
from pallas_kernels.rope import MAX_ROPE_POSITION, RopeConfig

__all__ = [
    "MAX_ROPE_POSITION",
    "RopeConfig",
    "lazy_attention",
    "lazy_attention_reference",
    "plan_lazy_attention",
]
