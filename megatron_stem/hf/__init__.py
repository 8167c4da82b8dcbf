"""Hugging Face export and import of megatron-stem models.

  names.py            THE map: megatron <-> HF tensor names, layouts, shapes, config
  dist_io.py          megatron dist checkpoints, one tensor at a time (read and write)
  safetensors_io.py   sharded safetensors, streamed
  tokenizer_files.py  the tokenizer files an export ships
  export.py           checkpoint -> HF folder (tools/to_hf.py); dense -> plain Llama
  import_.py          HF folder (ours, or a Llama) -> checkpoint (tools/from_hf.py)
  remote/             the HF config and modeling code copied into every STEM export;
                      they import only torch and transformers
"""
