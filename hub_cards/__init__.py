"""Model card templates for exported DFlash drafters (installed as `dflash_hf.hub_cards`)."""
