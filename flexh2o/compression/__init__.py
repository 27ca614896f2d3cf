"""Low-bit weights and cache: the 4-bit group format (quant.py), GGUF blocks and 16-bit matrices
kept as stored (gguf_blocks.py), torch's int4 tile layout, flexh2o's grouped product, dequantizing
on the GPU, and which kernel multiplies a compressed matrix at a given row count."""
