"""refimpl: every parallelism strategy of distributed LLM training, written from first principles.
One module per idea (DESIGN.md). Import submodules explicitly (`from refimpl import launch`), so
`import refimpl` stays cheap in a rank that has not imported torch yet."""
__version__ = "0.1.0"
