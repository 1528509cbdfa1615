"""Small-config rewrites of Flax's example models (lm1b, wmt, gemma) and what their tests share.

The models are imported as ``support.real_models.lm1b_model`` and so on; ``harness`` holds the
synthetic batches, the leaf-by-leaf comparisons and the byte counts of
``tests/integration/real_models/``.
"""
