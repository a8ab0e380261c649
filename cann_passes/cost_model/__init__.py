"""Cost model: device profiles, roofline time per node, alpha-beta time per collective."""
from .collectives import collective_node_time, collective_time
from .profiles import DeviceProfile, cpu_profile, get_profile, profile_names
from .roofline import graph_time, node_time

__all__ = ["DeviceProfile", "collective_node_time", "collective_time", "cpu_profile", "get_profile",
           "graph_time", "node_time", "profile_names"]
