"""The harness of the grpo_ext microbenchmarks: what every ``bench_<op>.py`` script shares, one module per seam.

* :mod:`harness.cli`: the shared options (each script takes those it honours), and parsers of sizes, lists and
  dtypes, each also an argparse ``type``, so that a bad value stops a run at parsing with the option named.
* :mod:`harness.environment`: the device to run on and the facts about machine and software; its ``start`` begins a
  run (device, facts, copy bandwidth, L2 flusher).
* :mod:`harness.timing`: how a call is timed on CUDA and on CPU (the method is in that module's docstring), the
  copy-bandwidth yardstick, the LM head's GEMM floor and the peak-memory probe.
* :mod:`harness.peers`: the optional peers (torch.compile, CUDA-graph replay), their warm-up, and the timing of every
  peer of a case.
* :mod:`harness.checks`: the agreement check against a float64 reference and its tolerances; a peer that
  disagrees becomes an n/a row with the reason, the run goes on.
* :mod:`harness.reporting`: the derived columns, the printed table and the JSON record.

The scripts put their own folder (``benchmarks/``) on ``sys.path`` first, so they import ``harness`` whether they are
run from the repo root (``python benchmarks/bench_grpo_loss.py``) or from anywhere by absolute path.
"""
