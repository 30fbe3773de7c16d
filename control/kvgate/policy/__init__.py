"""Routing policy: YAML → validated model."""

from .loader import PolicyError, PolicyIssue, dump_policy, load_policy, parse_policy, parse_policy_text
from .model import (
    CacheConfig,
    GatewayConfig,
    NodeConfig,
    Policy,
    PoolConfig,
    RedisConfig,
    SimulatorConfig,
)

__all__ = [
    "CacheConfig", "GatewayConfig", "NodeConfig", "Policy", "PolicyError", "PolicyIssue",
    "PoolConfig", "RedisConfig", "SimulatorConfig", "dump_policy", "load_policy", "parse_policy", "parse_policy_text",
]
