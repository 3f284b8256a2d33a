"""Models that pick their attention kind by name: the causal LM `GPT` and the classifier `Encoder`.

Their configs live in `piattn.config` and are re-exported here.
"""

from ..config import SIZES, EncoderConfig, GPTConfig, ModelConfig
from .encoder import Encoder
from .gpt import GPT

__all__ = ["GPT", "SIZES", "Encoder", "EncoderConfig", "GPTConfig", "ModelConfig"]
