"""fleetline: an event-sourced stream-processing control plane for multi-cluster GPU fleets."""

from fleetline.config import Settings
from fleetline.errors import FleetlineError

__all__ = ["FleetlineError", "Settings"]
__version__ = "0.1.0"
