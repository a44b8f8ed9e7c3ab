"""Remote code of DFlash checkpoints, installed as `dflash_hf.modeling` (self-contained: torch + transformers)."""

from .configuration_dflash import DFlashConfig, default_target_layer_ids
from .modeling_dflash import DFlashDraftModel, DFlashPreTrainedModel

__all__ = ["DFlashConfig", "DFlashDraftModel", "DFlashPreTrainedModel", "default_target_layer_ids"]
