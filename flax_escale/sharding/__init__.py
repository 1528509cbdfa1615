"""Layer 4: applying shardings to arrays and trees."""

from flax_escale.sharding.constraint import apply_spec, with_sharding_constraint
from flax_escale.sharding.logical import constrain

__all__ = ["apply_spec", "constrain", "with_sharding_constraint"]
