"""dflash-hf: DFlash block-diffusion speculative decoding for Hugging Face Transformers.

>>> import dflash_hf
>>> drafter = dflash_hf.DFlashDraftModel.from_pretrained("org/dflash-drafter")
>>> out = dflash_hf.generate(target, drafter, input_ids, max_new_tokens=128)
>>> out = target.generate(**inputs, assistant_model=drafter, speculation_type="dflash")  # native path
"""

from transformers import AutoConfig, AutoModel

from .engine.block_size import AdaptiveBlockSize, BlockSizePolicy, FixedBlockSize
from .engine.generation import DFlashGenerateOutput, custom_generate, generate
from .hub.export import export
from .hub.push import push_to_hub, validate_hub_folder
from .modeling import DFlashConfig, DFlashDraftModel, DFlashPreTrainedModel, default_target_layer_ids
from .target import SUPPORTED_TARGET_TYPES, TargetAdapter

__version__ = "0.1.0"


def _register_auto_classes() -> None:
    """Make `AutoConfig`/`AutoModel` resolve `model_type="dflash"`, and `save_pretrained` write `auto_map`."""
    try:
        AutoConfig.register(DFlashConfig.model_type, DFlashConfig)
        AutoModel.register(DFlashConfig, DFlashDraftModel)
    except ValueError:  # already registered (module re-import)
        pass
    DFlashConfig.register_for_auto_class("AutoConfig")
    DFlashDraftModel.register_for_auto_class("AutoModel")


_register_auto_classes()

__all__ = [
    "AdaptiveBlockSize",
    "BlockSizePolicy",
    "FixedBlockSize",
    "SUPPORTED_TARGET_TYPES",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashGenerateOutput",
    "DFlashPreTrainedModel",
    "TargetAdapter",
    "custom_generate",
    "default_target_layer_ids",
    "export",
    "generate",
    "push_to_hub",
    "validate_hub_folder",
]
