"""Configuration, in one place that imports nothing else from piattn: the π operator's settings and their
defaults, model sizes and configs, and the sectioned flags of a training run."""

from .model import SIZES, EncoderConfig, GPTConfig, ModelConfig
from .pi import GATED_VARIANTS, PI_DEFAULTS, VARIANTS, PiSettings
from .training import PRECISIONS, TrainConfig

__all__ = ["GATED_VARIANTS", "PI_DEFAULTS", "PRECISIONS", "SIZES", "VARIANTS", "EncoderConfig", "GPTConfig",
           "ModelConfig", "PiSettings", "TrainConfig"]
