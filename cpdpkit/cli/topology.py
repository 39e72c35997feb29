"""``cpdpkit topology show NAME|FILE``: print a topology (tiers, levels, placement) as a table.

On a topology whose tiers vary (``latency_jitter_frac``, ``bandwidth_jitter_frac``) it shows
each tier's jitter and, per collective, the mean time (what the planner uses) beside the range
the emulator samples from (:meth:`cpdpkit.network.NetworkGroup.time_range_s`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from cpdpkit.cli._app import app, out_console

if TYPE_CHECKING:  # cpdpkit.topology loads when the command runs, not for every `cpdpkit --help`
    from cpdpkit.topology import Tier, Topology, TopologySpec

__all__ = ["topology_app", "render_topology"]

topology_app = typer.Typer(
    help="Inspect network topologies (presets: lan, wan, wan-variable, cluster, multisite; or a TOML file).",
    no_args_is_help=True)
app.add_typer(topology_app, name="topology")

_SAMPLE_BYTES = 4 * 1024 * 1024


def _fmt_latency(latency_s: float) -> str:
    return f"{latency_s * 1e3:.3g} ms" if latency_s >= 1e-3 else f"{latency_s * 1e6:.3g} us"


def _fmt_bandwidth(bandwidth_bytes_per_s: float) -> str:
    gbit = bandwidth_bytes_per_s * 8 / 1e9
    return f"{bandwidth_bytes_per_s / 1e9:.4g} GB/s ({gbit:.4g} Gbit/s)"


def _fmt_jitter(tier: Tier) -> str:
    if not tier.is_variable:
        return "-"
    parts = []
    if tier.latency_jitter_frac:
        parts.append(f"latency ±{tier.latency_jitter_frac:.0%}")
    if tier.bandwidth_jitter_frac:
        jb, gbit = tier.bandwidth_jitter_frac, tier.bandwidth_bytes_per_s * 8 / 1e9
        parts.append(f"transfer ±{jb:.0%} ({gbit / (1 + jb):.3g}-{gbit / (1 - jb):.3g} Gbit/s)")
    return ", ".join(parts)


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def render_topology(topo: Topology | TopologySpec) -> list[Table]:
    """Rich tables: tiers with the levels that use them, and (when placed) sample collective costs."""
    from cpdpkit.topology import COLLECTIVE_OPS, Topology, format_ranks

    levels = {"intra_node_tier": "same node", "inter_node_tier": "same site", "inter_site_tier": "between sites"}
    # a name or description from a TOML file is text, never rich markup ("[/x]" would raise MarkupError)
    tiers = Table(title=f"topology {escape(topo.name)}: {topo._shape()}", title_justify="left")
    for col in ("tier", "latency (one way)", "bandwidth", "links", "jitter"):
        tiers.add_column(col)
    for t in topo.tiers:
        used = ", ".join(label for f, label in levels.items() if getattr(topo, f) == t.name) or "-"
        tiers.add_row(t.name, _fmt_latency(t.latency_s), _fmt_bandwidth(t.bandwidth_bytes_per_s), used,
                      _fmt_jitter(t))
    if not isinstance(topo, Topology):
        return [tiers]
    world = topo.world_size
    costs = Table(title=f"modeled time of {_SAMPLE_BYTES >> 20} MiB over all {world} ranks "
                        f"(ranks {format_ranks(range(world))})", title_justify="left")
    variable = any(t.is_variable for t in topo.tiers)
    for col in ("op", "tier", "algorithm", *(("time (mean)", "range (min-max)") if variable else ("time",))):
        costs.add_column(col)
    for op in COLLECTIVE_OPS:
        group = topo.group([0, world - 1] if op == "send_recv" else range(world))
        num_bytes = 0 if op == "barrier" else _SAMPLE_BYTES
        c = group.cost(op, num_bytes)
        row = [op if op != "send_recv" else f"send_recv 0->{world - 1}", c.tier or "-", c.algorithm, _fmt_ms(c.time_s)]
        if variable:
            low, high = group.time_range_s(op, num_bytes)
            row.append(f"{low * 1e3:.3f}-{_fmt_ms(high)}" if high > low else "-")
        costs.add_row(*row)
    return [tiers, costs]


@topology_app.command("show")
def show(
    spec: str = typer.Argument(..., metavar="NAME|FILE",
                               help="Preset (lan, wan, wan-variable, cluster, multisite) or a topology .toml file."),
    world_size: int | None = typer.Option(None, "--world-size", "-n", help="Place it on this many ranks."),
    ranks_per_node: int | None = typer.Option(None, "--ranks-per-node", help="Override ranks per node."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Show a topology's tiers, placement and modeled collective times."""
    from cpdpkit.topology import Topology, resolve_topology

    topo = resolve_topology(spec, world_size=world_size, ranks_per_node=ranks_per_node)
    fixed = None if isinstance(topo, Topology) else topo.fixed_world_size
    topo = topo if fixed is None else topo.place(fixed)  # every count given: placed without --world-size
    if as_json:
        out_console.print_json(json.dumps(topo.to_dict()))
        return
    if topo.description:
        out_console.print(topo.description, soft_wrap=True, markup=False)
    for table in render_topology(topo):
        out_console.print(table)
    if not isinstance(topo, Topology):
        out_console.print("(pass --world-size N to place it and see modeled collective times)")
