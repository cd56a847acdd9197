"""Request → token IDs, locally.

- `local`: local render: chat template and per-turn cached tokenization on worker threads
- `chat_template`: the model folder's chat template in a sandboxed jinja2 environment
- `tokenizer_folder`: a model folder read as transformers reads it (tokenizer, special tokens, templates)
"""
