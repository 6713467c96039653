"""What communication costs: the bytes each collective sends (`collective_bytes`), and the alpha-beta
model and its fit (`alpha_beta`)."""
