"""What communication costs: bytes per collective (collective_bytes), the alpha-beta model (alpha_beta)."""
