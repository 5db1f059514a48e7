"""Inference-time alignment: search the denoising process for samples the reward prefers,
without training (docs/search.md). Every method charges one ledger per prompt and stops at its
budget of network evaluations: best-of-N and SMC (particles.py), DTS and DTS* (dts.py), run by
name (run.py) for a flowrl policy (policy.py); the config's section is options.py."""
