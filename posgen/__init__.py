"""posgen: declarative specs and code generation for Transformer positional encodings."""

__version__ = "0.1.0"
