"""The sharding constraints of a lowered program, for tests that look for one.

A program lowered under an Explicit mesh holds ``sdy.sharding_constraint`` ops of its own (open,
``[{}, {}]``) and every program with sharded inputs holds the word "sharding": a test must look for
the constraint it expects, with its exact sharding and type.
"""

import re

_CONSTRAINT = re.compile(r"sdy\.sharding_constraint %[\w#.]+ <@\w+, (\[[^>]*\])> : tensor<([^>]*)>")


def sharding_constraints(text: str) -> list[tuple[str, str]]:
    """``(sharding, type)`` of each constraint in ``text``, in program order.

    For example ``('[{"fsdp", "dp"}, {"tp"}]', "8x16xf32")``.
    """
    return _CONSTRAINT.findall(text)
