"""Port derivation: reward-model ports = policy ports + offset; server *i* uses ``group_port + i``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

DEFAULT_POLICY_HTTP_PORT = 8000
DEFAULT_POLICY_GROUP_PORT = 51216
DEFAULT_PORT_OFFSET = 1
DEFAULT_HTTP_PORT = DEFAULT_POLICY_HTTP_PORT + DEFAULT_PORT_OFFSET  # 8001
DEFAULT_GROUP_PORT = DEFAULT_POLICY_GROUP_PORT + DEFAULT_PORT_OFFSET  # 51217


def _check_port(value: int, what: str) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"{what} {value} is outside 1..65535; choose a valid TCP port")
    return value


class RewardModelPorts(BaseModel):
    model_config = ConfigDict(frozen=True)

    http: int
    group: int

    def replica_group_port(self, index: int) -> int:
        """Group port of server ``index`` when each replica has its own group: ``group + i``."""
        return replica_group_port(self.group, index)


def derive_ports(
    policy_http_port: int = DEFAULT_POLICY_HTTP_PORT,
    policy_group_port: int = DEFAULT_POLICY_GROUP_PORT,
    offset: int = DEFAULT_PORT_OFFSET,
) -> RewardModelPorts:
    """Reward-model ports = policy ports + offset (default +1: HTTP 8001, NCCL group 51217)."""
    _check_port(policy_http_port, "policy HTTP port")
    _check_port(policy_group_port, "policy group port")
    return RewardModelPorts(
        http=_check_port(
            policy_http_port + offset, f"HTTP port (policy {policy_http_port} + offset {offset})"
        ),
        group=_check_port(
            policy_group_port + offset, f"group port (policy {policy_group_port} + offset {offset})"
        ),
    )


def replica_group_port(group_port: int, index: int) -> int:
    if index < 0:
        raise ValueError(f"replica index must be >= 0, got {index}")
    return _check_port(group_port + index, f"group port {group_port} + replica {index}")


def replica_group_ports(group_port: int, count: int) -> list[int]:
    return [replica_group_port(group_port, i) for i in range(count)]


def pair_servers(base_urls: str | list[str], group_ports: int | list[int]) -> list[tuple[str, int]]:
    """The legacy paired-list form of multi-server configs: lists pair by index; one int derives ``group_port + i``."""
    if isinstance(base_urls, str):
        if not isinstance(group_ports, int):
            raise ValueError("a single base_url takes a single int group_port")
        return [(base_urls, _check_port(group_ports, "group port"))]
    if not base_urls:
        raise ValueError("base_urls is empty: give at least one reward server URL")
    if isinstance(group_ports, int):
        return list(zip(base_urls, replica_group_ports(group_ports, len(base_urls)), strict=True))
    if len(group_ports) != len(base_urls):
        raise ValueError(
            f"{len(base_urls)} base_urls but {len(group_ports)} group_ports: give one group port per "
            "server, or a single int to derive group_port + i"
        )
    return [(u, _check_port(p, "group port")) for u, p in zip(base_urls, group_ports, strict=True)]
