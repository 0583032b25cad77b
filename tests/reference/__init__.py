"""Independent float64 reference implementations of positional encodings, written from the papers."""
