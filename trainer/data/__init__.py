"""Data: the shard stage (``shard``), reading shards (``tokens``) and the global sample order (``sampler``).

The shard stage is a map over pieces: ``plan`` cuts the corpus into them, ``piece`` tokenizes one (on any
worker), ``shard`` plans, assembles and runs the three in one process. ``sources`` opens a corpus (the stdlib,
text files, JSON lines, Parquet, Arrow) within its bounds, ``parquet_pages`` reads Parquet page by page,
``tokenizer`` the byte and BPE tokenizers, ``format`` the dataset format, ``source_hashes`` the orchestrator's
cache of source files' hashes by their stat.
"""
