"""A committed checkpoint as a model people load (docs/architecture.md §11), in the orchestrator's process.

``folder``: ``export_checkpoint``, a checkpoint to a Hugging Face folder, checked bit for bit ·
``consolidate``: the model's blocks out of DCP's files, each file verified as it streams ·
``safetensors_out``: a safetensors file laid out from shapes and written block by block ·
``architectures``: which stock transformers architecture a model factory's model is ·
``tokenizer``: the run's tokenizer as a stock fast tokenizer.
"""
