"""The inference engine: the generation loop and its parts (acceptance, block-size policies, cache edits, logits
processing, the target adapter)."""
