"""Flax (NNX) Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) whose
attention calls the lazy attention kernel contract.

Import from the modules: `models.llama` (the model), `models.config`,
`models.params` (parameter layout), `models.architectures` (the supported
families), `models.paged_inputs`, `models.dense_reference` (the parity
reference), `models.gguf_loader` and `models.safetensors_loader` (weights;
`models.errors.ModelFormatError` for a bad file), `models.tokenizer`.  The
package itself imports none of them, so using one does not load the others'
dependencies (`gguf`, `tokenizers`, jinja2).
"""
