"""The MoE examples' workloads, one factory per API and dispatch strategy, for the surveys."""

import dataclasses

from support.example_modules import load


def _workload(api: str, strategy: str):
    example = load(f"{api}_moe")
    config = dataclasses.replace(load("moe_config").SMALL, strategy=strategy)
    return example.workload(config, batch=8)


def linen_capacity():
    return _workload("linen", "capacity")


def linen_dropless():
    return _workload("linen", "dropless")


def nnx_capacity():
    return _workload("nnx", "capacity")


def nnx_dropless():
    return _workload("nnx", "dropless")
