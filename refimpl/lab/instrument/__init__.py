"""The lab's instruments: labels and byte counts on refimpl.seam (attach.py), the CommLog a test or a\nnotebook opens (labels.py)."""
