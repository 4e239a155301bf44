"""The check every export test makes: a checkpoint's exported folder, loaded by stock transformers as it is,
gives trainpipe's own forward's logits (fp32, within 1e-5), and its tokenizer encodes as the run's does."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = "def main():\n    return 'héllo, world' # ünïcode\n"


def exported_logits_match(uri: str, folder: Path, profile, tolerance: float = 1e-5) -> float:
    """The largest difference between trainpipe's forward of ``uri`` and transformers' of ``folder`` on a fixed
    batch; asserts it is within ``tolerance``."""
    from transformers import AutoModelForCausalLM

    from trainpipe.trainer.checkpoint.catalog import require_valid
    from trainpipe.trainer.checkpoint.validate import load_model, run_profile_for

    so = profile.store.storage_options
    manifest = require_valid(uri, so).manifest
    recorded = run_profile_for(uri, manifest, profile)
    ours = load_model(uri, recorded, so, manifest).eval()
    theirs = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    batch = torch.randint(
        0, recorded.model.vocab_size, (2, recorded.model.block_size), generator=torch.Generator().manual_seed(7)
    )
    with torch.no_grad():
        mine, stock = ours(batch)[0].float(), theirs(batch).logits.float()
    assert mine.shape == stock.shape
    diff = (mine - stock).abs().max().item()
    assert diff <= tolerance, f"logits differ by {diff}"
    return diff


def tokenizer_encodes_as_the_runs(folder: Path, dataset_uri: str, storage_options: dict | None = None) -> list[int]:
    """AutoTokenizer's ids of ``TEXT`` equal the dataset's tokenizer's; returns them."""
    from transformers import AutoTokenizer

    from trainpipe.trainer.data.format import load_manifest
    from trainpipe.trainer.data.tokenizer import ByteTokenizer, from_json

    manifest = load_manifest(dataset_uri, storage_options)
    entry = manifest["tokenizer"]
    if "file" in entry:
        from trainpipe.trainer.data.format import files_base
        from trainpipe.trainer.store import filesystem

        fs, base = filesystem(files_base(dataset_uri, manifest), storage_options)
        from tokenizers import Tokenizer

        body = fs.cat_file(f"{base}/{entry['file']}").decode()
        eot = Tokenizer.from_str(body).id_to_token(entry["eot"])
        ours = from_json(body, entry["name"], eot, "dataset").encode([TEXT])[0].tolist()
    else:
        ours = ByteTokenizer().encode([TEXT])[0].tolist()
    stock = AutoTokenizer.from_pretrained(str(folder))(TEXT, add_special_tokens=False)["input_ids"]
    assert stock == ours
    return stock
