"""Models that pick their attention kind by name: the causal LM `GPT`, the classifier `Encoder` and the
image-text `DualEncoder` (CLIP, over the `ImageEncoder` ViT).

Their configs live in `piattn.config` and are re-exported here.
"""

from ..config import SIZES, EncoderConfig, GPTConfig, ModelConfig
from ..config.vision import VisionLanguageConfig
from .encoder import Encoder
from .gpt import GPT
from .vision import DualEncoder, ImageEncoder, clip_loss

__all__ = ["GPT", "SIZES", "DualEncoder", "Encoder", "EncoderConfig", "GPTConfig", "ImageEncoder", "ModelConfig",
           "VisionLanguageConfig", "clip_loss"]
