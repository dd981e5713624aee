"""The pipeline's stages, in order (kept free of imports so `status` starts fast)."""

STAGES = ("data", "extract", "train", "export", "eval")
