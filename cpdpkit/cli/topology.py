"""``cpdpkit topology show NAME|FILE``: print a topology (tiers, levels, placement) as a table."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from cpdpkit.cli.app import app, out_console

if TYPE_CHECKING:  # cpdpkit.topology loads when the command runs, not for every `cpdpkit --help`
    from cpdpkit.topology import Topology

__all__ = ["topology_app", "render_topology"]

topology_app = typer.Typer(help="Inspect network topologies (presets: lan, wan, cluster; or a TOML file).",
                           no_args_is_help=True)
app.add_typer(topology_app, name="topology")

_SAMPLE_BYTES = 4 * 1024 * 1024


def _fmt_latency(latency_s: float) -> str:
    return f"{latency_s * 1e3:.3g} ms" if latency_s >= 1e-3 else f"{latency_s * 1e6:.3g} us"


def _fmt_bandwidth(bandwidth_bytes_per_s: float) -> str:
    gbit = bandwidth_bytes_per_s * 8 / 1e9
    return f"{bandwidth_bytes_per_s / 1e9:.4g} GB/s ({gbit:.4g} Gbit/s)"


def render_topology(topo: Topology) -> list[Table]:
    """Rich tables: tiers with the levels that use them, and (when placed) sample collective costs."""
    from cpdpkit.topology import COLLECTIVE_OPS, format_ranks

    levels = {"intra_node_tier": "same node", "inter_node_tier": "same site", "inter_site_tier": "between sites"}
    tiers = Table(title=f"topology {topo.name}: {topo._shape()}", title_justify="left")
    for col in ("tier", "latency (one way)", "bandwidth", "links", "jitter"):
        tiers.add_column(col)
    for t in topo.tiers:
        used = ", ".join(label for f, label in levels.items() if getattr(topo, f) == t.name) or "-"
        tiers.add_row(t.name, _fmt_latency(t.latency_s), _fmt_bandwidth(t.bandwidth_bytes_per_s), used,
                      f"±{t.jitter_frac:.0%}" if t.jitter_frac else "-")
    if not topo.is_placed:
        return [tiers]
    world = topo.world_size or 1
    costs = Table(title=f"modeled time of {_SAMPLE_BYTES >> 20} MiB over all {world} ranks "
                        f"(ranks {format_ranks(range(world))})", title_justify="left")
    for col in ("op", "tier", "algorithm", "time"):
        costs.add_column(col)
    for op in COLLECTIVE_OPS:
        ranks = [0, world - 1] if op == "send_recv" else range(world)
        c = topo.collective_cost(op, 0 if op == "barrier" else _SAMPLE_BYTES, ranks)
        costs.add_row(op if op != "send_recv" else f"send_recv 0->{world - 1}", c.tier or "-", c.algorithm,
                      f"{c.time_s * 1e3:.3f} ms")
    return [tiers, costs]


@topology_app.command("show")
def show(
    spec: str = typer.Argument(..., metavar="NAME|FILE", help="Preset (lan, wan, cluster) or a topology .toml file."),
    world_size: int | None = typer.Option(None, "--world-size", "-n", help="Place it on this many ranks."),
    ranks_per_node: int | None = typer.Option(None, "--ranks-per-node", help="Override ranks per node."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Show a topology's tiers, placement and modeled collective times."""
    from cpdpkit.topology import resolve_topology

    topo = resolve_topology(spec, world_size=world_size, ranks_per_node=ranks_per_node)
    if as_json:
        out_console.print_json(json.dumps(topo.to_dict()))
        return
    if topo.description:
        out_console.print(topo.description, soft_wrap=True)
    for table in render_topology(topo):
        out_console.print(table)
    if not topo.is_placed:
        out_console.print("(pass --world-size N to place it and see modeled collective times)")
