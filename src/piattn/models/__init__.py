"""Models that pick their attention kind by name: the causal LM `GPT` and the classifier `Encoder`."""

from .config import SIZES, EncoderConfig, GPTConfig, ModelConfig
from .encoder import Encoder
from .gpt import GPT

__all__ = ["GPT", "SIZES", "Encoder", "EncoderConfig", "GPTConfig", "ModelConfig"]
