"""Hugging Face export and import of megatron-stem models.

  names.py            THE map: megatron <-> HF tensor names, layouts, shapes, config
  safetensors_io.py   sharded safetensors, streamed
  tokenizer_files.py  the tokenizer files an export ships
  export.py           checkpoint -> HF folder (tools/to_hf.py); dense -> plain Llama
  import_model.py     HF folder (ours, or a Llama) -> checkpoint (tools/from_hf.py)
  remote/             the HF config and modeling code copied into every STEM export;
                      they import only torch and transformers

A megatron checkpoint is read and written one tensor at a time by `checkpoint/streaming.py`.
"""
