"""Shared by the model tests: tiny Hugging Face checkpoints made offline, saved once per module."""
import torch

from ..helpers import save_hf


def hf_checkpoints(tmp_path_factory, configs: dict, seed: int):
    """get(name) -> (HF model in eval mode, its save_pretrained dir); configs[name]() gives
    (config, model class). Built on first use with torch.manual_seed(seed), then reused."""
    made = {}

    def get(name):
        if name not in made:
            torch.manual_seed(seed)
            config, cls = configs[name]()
            hf = cls(config).eval()
            made[name] = hf, save_hf(tmp_path_factory, name, hf)
        return made[name]
    return get
