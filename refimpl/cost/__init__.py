"""What communication costs: the bytes each collective sends (`collective_bytes`), the alpha-beta
model and its fit (`alpha_beta`), and the GPU datasheet presets (`hardware`)."""
