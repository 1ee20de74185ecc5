"""A tiny tokenizer with a ChatML template and a tiny model over its
vocabulary, so the training recipes run end to end on text in seconds."""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lazyattn_jax.training.data import SyntheticFacts
from models.config import LlamaConfig
from models.tokenizer import LlamaTokenizer

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n"
    "You answer from the documents.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 256


@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> LlamaTokenizer:
  """A Metaspace BPE of exactly 256 ids trained on the synthetic facts."""
  backend = Tokenizer(models.BPE(unk_token="<unk>"))
  backend.pre_tokenizer = pre_tokenizers.Metaspace()
  backend.decoder = decoders.Metaspace()
  source = SyntheticFacts(size=400, seed=99)
  texts = [t for i in range(len(source)) for t in (
      *source[i].documents, source[i].query, source[i].answer)]
  texts.append("You answer from the documents. system user assistant")
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                initial_alphabet=["\n"], show_progress=False)
  backend.train_from_iterator(texts, trainer)
  assert backend.get_vocab_size() == VOCAB, backend.get_vocab_size()
  return LlamaTokenizer(backend, bos_token_id=None,
                        eos_token_id=backend.token_to_id("<|im_end|>"),
                        chat_template=CHATML)


def tiny_config(**overrides) -> LlamaConfig:
  return LlamaConfig.tiny(vocab_size=VOCAB, **overrides)


def export_tiny_model(directory) -> str:
  """The tiny model (seed 0) and tokenizer as a safetensors directory, as
  `lazyattn finetune --model` and `from_pretrained` read it."""
  from flax import nnx
  from lazyattn_jax.training.export import export_model
  from models.llama import Llama
  model = Llama(tiny_config(), rngs=nnx.Rngs(0))
  return export_model(directory, model.config,
                      nnx.to_pure_dict(nnx.state(model)), tiny_tokenizer())
