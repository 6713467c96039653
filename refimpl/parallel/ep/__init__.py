"""Expert parallelism: each rank of an ep group holds E/ep experts; tokens travel by all-to-all
(dispatch.py); routing counts gathered over the ranks holding the other tokens (counts.py)."""
