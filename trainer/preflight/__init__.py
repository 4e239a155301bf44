"""Preflight: rank-side probes (``probes``, ``gpu_health``; ``python -m trainpipe.trainer.preflight`` under torchrun)
and reading their report (``report``)."""
