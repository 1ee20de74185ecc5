"""Flax (NNX) Llama whose attention calls the lazy attention kernel contract."""
