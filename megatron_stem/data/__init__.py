"""Data preparation: input readers, Megatron .bin/.idx writing, the preprocessing pipeline.

Nothing here imports torch or megatron-core, so preprocessing workers start fast.
"""
