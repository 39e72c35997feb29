"""The error hierarchy for user mistakes.

Every error a user can cause derives from :class:`CpdpkitError`; the CLI turns it into one
red line and exit code 2. Messages name the bad value and the fix. Internal invariants use
``assert`` instead.
"""

from __future__ import annotations

__all__ = [
    "CpdpkitError",
    "ConfigError",
    "TopologyError",
    "DistributedSetupError",
    "TraceError",
    "LaunchError",
]


class CpdpkitError(Exception):
    """Base class of every user-facing cpdpkit error."""


class ConfigError(CpdpkitError, ValueError):
    """A configuration value is out of range or inconsistent (names the value and the fix)."""


class TopologyError(ConfigError):
    """A topology description (preset, TOML file or placement) is invalid."""


class DistributedSetupError(CpdpkitError, RuntimeError):
    """The process group, the ranks or the model do not fit the requested synchronisation."""


class TraceError(CpdpkitError):
    """A trace file or folder cannot be read or analysed."""


class LaunchError(CpdpkitError, RuntimeError):
    """A launched job could not start or one of its ranks failed."""
