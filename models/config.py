"""Shape and hyper-parameters of a Llama-architecture decoder."""

from __future__ import annotations

import dataclasses
import numbers

from pallas_kernels.rope import MAX_ROPE_POSITION, RopeConfig


def whole_number(value, name: str) -> int:
  """`value` as an int when it is one (a JSON or GGUF integer, numpy's
  included).

  Raises:
    ValueError: naming `name`, for anything else (1.5, True, "12"), which
      `int()` would truncate or parse where transformers and llama.cpp
      fail.
  """
  if isinstance(value, numbers.Integral) and not isinstance(value, bool):
    return int(value)
  raise ValueError(f"{name} must be an integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama-3 frequency scaling (HF `rope_type: llama3`), hashable."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """A Llama-family decoder: embeddings, RMSNorm, GQA attention with RoPE,
  SwiGLU; optionally biases on Q, K and V (Qwen2) and RMSNorm over each head
  of Q and K (Qwen3).

  Attributes:
    vocab_size: number of token ids.
    hidden_size: width of the residual stream (D).
    num_layers: decoder blocks (L).
    num_heads: query heads (N).
    num_kv_heads: key/value heads (K); N must be a multiple of K.
    head_dim: per-head width (H), even.
    intermediate_size: SwiGLU hidden width (I).
    rope_theta: RoPE base.
    rope_scaling: Llama-3 frequency scaling, or None for plain RoPE.
    rms_norm_eps: epsilon of every RMSNorm.
    tie_word_embeddings: the output projection is the embedding table.
    max_position: longest logical position the model is used at.
    bos_token_id: optional special id (informational).
    eos_token_id: the end-of-sequence id, a tuple of them where the model
      has several (each stops generation), or None.
    attention_bias: the Q, K and V projections add a bias (Qwen2).
    qk_norm: each head of Q and K goes through its own RMSNorm (weights of
      size head_dim, shared by the heads) before RoPE (Qwen3).
  """

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  rope_theta: float = 10000.0
  rope_scaling: Llama3RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = False
  max_position: int = 8192
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  attention_bias: bool = False
  qk_norm: bool = False

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "intermediate_size",
                 "max_position"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"LlamaConfig.{name} must be a positive int, got {value!r}")
    for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"LlamaConfig.{name} must be a bool, got "
                         f"{getattr(self, name)!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"LlamaConfig.num_heads ({self.num_heads}) must be a multiple of "
          f"num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(
          f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
    if not self.rope_theta > 1.0:
      raise ValueError(
          f"LlamaConfig.rope_theta must be > 1, got {self.rope_theta!r}")
    if not self.rms_norm_eps > 0.0:
      raise ValueError(
          f"LlamaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
    if self.max_position > MAX_ROPE_POSITION // 2:
      raise ValueError(
          f"LlamaConfig.max_position must be at most "
          f"{MAX_ROPE_POSITION // 2} (positions below it are in the kernels' "
          f"exact RoPE range), got {self.max_position}")
    if self.rope_scaling is not None and not isinstance(
        self.rope_scaling, Llama3RopeScaling):
      raise ValueError(
          "LlamaConfig.rope_scaling must be a Llama3RopeScaling or None, got "
          f"{type(self.rope_scaling).__name__}")
    if isinstance(self.eos_token_id, tuple) and not self.eos_token_id:
      raise ValueError("LlamaConfig.eos_token_id must be an id, a non-empty "
                       "tuple of ids, or None, got ()")
    eos = (self.eos_token_id if isinstance(self.eos_token_id, tuple)
           else (self.eos_token_id,))
    for name, value in ([("bos_token_id", self.bos_token_id)] +
                        [("eos_token_id", v) for v in eos]):
      if value is not None and not 0 <= value < self.vocab_size:
        raise ValueError(
            f"LlamaConfig.{name} must lie in [0, {self.vocab_size}), got "
            f"{value!r}")
    # RopeConfig validates the scaling parameters; fail here, not at first use.
    try:
      self.rope  # pylint: disable=pointless-statement
    except ValueError as e:
      raise ValueError(f"LlamaConfig.rope_scaling is invalid: {e}") from e

  @property
  def rope(self) -> RopeConfig:
    """The kernels' RoPE description of this model."""
    if self.rope_scaling is None:
      return RopeConfig(theta=float(self.rope_theta))
    s = self.rope_scaling
    return RopeConfig(theta=float(self.rope_theta), factor=float(s.factor),
                      low_freq_factor=float(s.low_freq_factor),
                      high_freq_factor=float(s.high_freq_factor),
                      original_max_position=int(s.original_max_position))

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def tiny(cls, **overrides) -> "LlamaConfig":
    """A small random test model (fast on CPU)."""
    fields = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate_size=128,
                  rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, max_position=4096)
    fields.update(overrides)
    return cls(**fields)

  @classmethod
  def llama3_8b(cls, **overrides) -> "LlamaConfig":
    """The shape of Meta-Llama-3-8B (Llama-3 RoPE scaling as in 3.1)."""
    fields = dict(vocab_size=128256, hidden_size=4096, num_layers=32,
                  num_heads=32, num_kv_heads=8, head_dim=128,
                  intermediate_size=14336, rope_theta=500000.0,
                  rope_scaling=Llama3RopeScaling(
                      factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position=8192),
                  rms_norm_eps=1e-5, tie_word_embeddings=False,
                  max_position=8192, bos_token_id=128000, eos_token_id=128001)
    fields.update(overrides)
    return cls(**fields)
