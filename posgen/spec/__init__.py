"""The spec layer: the pydantic model of a spec, and the YAML loader that locates errors."""
