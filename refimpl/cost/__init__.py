"""What communication costs: measured sweeps and the alpha-beta fit (`bench`), the seed's
per-strategy table (`strategy_cost`), and volumes counted from traces (`volume`)."""
