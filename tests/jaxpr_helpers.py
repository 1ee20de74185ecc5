"""Reading jaxprs in tests."""

from __future__ import annotations

# How Pallas kernels appear in a jaxpr (Mosaic GPU kernels with several
# warpgroups as `mpmd_map`).
KERNEL_PRIMITIVES = frozenset({"pallas_call", "mpmd_map"})


def primitives(jaxpr, opaque=frozenset()) -> set[str]:
  """Names of every primitive in a jaxpr and its nested jaxprs (pjit, cond,
  scan...), not looking inside primitives named in `opaque`."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    if eqn.primitive.name in opaque:
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else [value]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          names |= primitives(inner, opaque)
  return names
