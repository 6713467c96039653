"""The launcher's tools (refimpl/lab/runtime/tools.py): the zygote, the flight recorder, the staged NCCL-rules\nbackend, the device audit."""
