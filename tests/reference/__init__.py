"""Independent float64 reference implementations of positional encodings, from the papers."""
