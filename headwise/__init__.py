"""headwise: multi-head attention from the layer to the API."""
from .attention import MultiHeadAttention, RotaryEmbedding, attend

__version__ = "0.1.0"
__all__ = ["attend", "MultiHeadAttention", "RotaryEmbedding"]
