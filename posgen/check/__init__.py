"""The property checker: hypothesis-driven tests of a spec's claims, reports and plots.

runner.py is the entry point (``check_loaded``, ``PROPERTIES``). The claims each have a
module (unique.py, relative.py, decay.py, extrapolates.py); the building blocks are
checked in rotation.py, buckets.py, slopes.py and agreement.py (backends, bf16, KV
cache). probe.py drives a module through its contract (contract.py), search.py runs the
time-budgeted hypothesis searches, verdicts.py holds the outcome types; report.py renders
them and plot.py draws them.
"""
