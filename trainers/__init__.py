"""DFlash training (installed as `dflash_hf.trainers`)."""
