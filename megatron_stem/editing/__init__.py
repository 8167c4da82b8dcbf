"""Knowledge editing and injection through STEM table rows.

Each (layer, token) row of a STEM table is a memory slot read whenever that token is the
input. Editing redirects or rewrites those slots; the input text is never changed.

  spec.py      edit specs (YAML/JSON): remaps (source -> target, strategy, layers) and
               injections (copy / average / given vectors)
  resolve.py   specs -> token ids and layers of one model, checked against it
  remap.py     length strategies, per-layer `stem_ids` for a batch, baking into rows
  inject.py    row writes (injections, baked remaps), applied and undone exactly
  forward.py   batched next-token distributions, answer scores, greedy decoding
  evaluate.py  edit success and locality in numbers
  backend.py   the model behind it: a megatron-stem checkpoint or a Hugging Face export
"""
