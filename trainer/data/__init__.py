"""Data: the shard stage (``shard``), reading shards (``tokens``) and the global sample order (``sampler``).

``sources`` opens a corpus (the stdlib, text files, JSON lines, Parquet, Arrow) within its bounds,
``parquet_pages`` reads Parquet page by page, ``tokenizer`` the byte and BPE tokenizers, ``format`` the
shard file format.
"""
