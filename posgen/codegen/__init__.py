"""The code generation layer: spec → plan (typed blocks) → rendered source → files."""
