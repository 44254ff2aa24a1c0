"""Decoder families as data: one module per family, one model for all (decoder.py).

A family module holds what differs between checkpoints' *descriptions*, never model code:

    config_from_hf(hf: dict, names: set[str]) -> ModelConfig   the block as ModelConfig fields
    weight_table(cfg) -> {HF name: To(headwise name, HF shape, transpose, add)}
    ignored(cfg) -> fnmatch patterns of HF tensors that are not weights
    Model = decoder.Decoder                                     the one decoder, built from cfg
    hf_name(name) -> name                                       optional: HF prefixes normalized

loading.FAMILIES maps HF model_type to the module. Adding a family: a module here (its
config_from_hf from hf.decoder_fields plus its own fields, its table) and a line in
loading.FAMILIES / ARCHITECTURES. A block feature no family had yet is a ModelConfig field read
by blocks.DecoderBlock / decoder.Decoder (and by the fused executor, or parts_of says it cannot).

Conventions: HF-named tensors in HF's layout are the interchange (a GGUF reader renames to them);
Gemma's norm weights w become 1 + w at load (To.add) so one RMSNorm (x / rms * weight) serves all.
"""
