"""Checkpoints in the object store (docs/architecture.md §3).

``catalog``: what a run's checkpoints are (inspect, verify, list, choose, prune, commit) ·
``checkpointer``: the ranks' one save path (sync or DCP-async) · ``loading``: state back
into a model · ``files``: reading a file of the store (regular, inside its folder, of its
size) · ``storage``: DCP's reader and writer over the store, each file verified and retried
whole · ``replicated``: a DDP resume read once by rank 0 and broadcast · ``validate``: prove a
checkpoint sane before anyone trusts it. ``interval``: the Young/Daly interval and what an interval costs.
``proof``: a checkpoint's proof of itself as its manifest records it (state hash, RNG hashes, sample ledger) ·
``state_hash``: computing them, the same at any world size · ``chain``: what a run's checkpoints
prove (``ckpt verify``) · ``memory_tier``: the private folder in host memory where the ranks' snapshots
outlive a crashed rank for the run's attempts · ``peer_copy``: the memory tier across hosts, each host's
snapshot files copied to a peer host and gathered back on restore · ``flash``: snapshots as each rank's
tensors copied into two shared-memory slots, an XXH3-64 checksum each · ``flash_peers``: those slots copied to
the rank of the same local rank on the next host, and fetched back on restore.
"""
