"""The property checker: hypothesis-driven tests of a spec's claims, reports and plots."""
