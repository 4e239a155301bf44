"""Data: the shard stage (``shard``), reading shards (``tokens``) and the global sample order (``sampler``)."""
