"""Optimizer settings shared by the sink and the fine-tuning recipes."""

from __future__ import annotations

import dataclasses
import math

import optax

from lazyattn_jax.training.errors import TrainingInputError


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Adam(W) with linear warm-up, cosine decay and global-norm clipping.

  Attributes:
    learning_rate: peak learning rate, reached after the warm-up.
    warmup_steps: steps of linear warm-up from 0.
    total_steps: length of the schedule (the run's steps).
    final_fraction: the rate decays (cosine) to this share of the peak.
    clip_norm: global gradient-norm clipping threshold.
    weight_decay: decoupled weight decay (0: plain Adam).
    b1, b2: Adam's moment decays.
  """
  learning_rate: float = 1e-5
  warmup_steps: int = 50
  total_steps: int = 1000
  final_fraction: float = 0.1
  clip_norm: float = 1.0
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.95

  def __post_init__(self):
    # isfinite too: an inf rate or a nan/inf decay passes the comparisons
    # and turns every weight into NaN at the first step.
    if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
      raise TrainingInputError(f"learning_rate must be finite and > 0, got "
                               f"{self.learning_rate}")
    if self.total_steps < 1 or self.warmup_steps < 0:
      raise TrainingInputError("total_steps must be >= 1 and warmup_steps "
                               ">= 0")
    if not 0 <= self.final_fraction <= 1 or not self.clip_norm > 0:
      raise TrainingInputError("final_fraction must lie in [0, 1] and "
                               "clip_norm be > 0")
    if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
      raise TrainingInputError(f"weight_decay must be finite and >= 0, got "
                               f"{self.weight_decay}")

  def schedule(self) -> optax.Schedule:
    """Learning rate per step."""
    warmup = min(self.warmup_steps, self.total_steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=self.learning_rate, warmup_steps=warmup,
        decay_steps=self.total_steps,
        end_value=self.learning_rate * self.final_fraction)

  def build(self) -> optax.GradientTransformation:
    """clip_by_global_norm, then AdamW (Adam when weight_decay is 0)."""
    return optax.chain(
        optax.clip_by_global_norm(self.clip_norm),
        optax.adamw(self.schedule(), b1=self.b1, b2=self.b2,
                    weight_decay=self.weight_decay))
