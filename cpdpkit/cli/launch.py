"""``cpdpkit launch``: run a script on N ranks with torchrun, optionally emulating a network."""

from __future__ import annotations

import typer
from rich.markup import escape

from cpdpkit.cli._app import app, err_console, out_console

__all__ = ["launch_command"]


@app.command(
    "launch",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
)
def launch_command(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="The Python script every rank runs; arguments after it go to it."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", "--nproc", help="Ranks on this node."),
    topology: str | None = typer.Option(None, "--topology", "-t",
                                        help="Emulate this topology: lan, wan, wan-variable, cluster, multisite "
                                             "or a .toml file."),
    profile: str | None = typer.Option(None, "--profile",
                                       help="Write each rank's torch.profiler trace and run.json here."),
    py_spy: str | None = typer.Option(None, "--py-spy", help="Record each rank with py-spy (speedscope) here."),
    nnodes: str = typer.Option("1", "--nnodes", help="Nodes (N or MIN:MAX), passed to torchrun."),
    node_rank: int | None = typer.Option(None, "--node-rank", help="Passed to torchrun."),
    rdzv_backend: str | None = typer.Option(None, "--rdzv-backend", help="Passed to torchrun."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help="Passed to torchrun."),
    rdzv_id: str | None = typer.Option(None, "--rdzv-id", help="Passed to torchrun."),
    master_addr: str | None = typer.Option(None, "--master-addr", help="Passed to torchrun."),
    master_port: int | None = typer.Option(None, "--master-port", help="Passed to torchrun (default: a free port)."),
    log_dir: str | None = typer.Option(None, "--log-dir", help="Rank logs (default: a temporary folder)."),
    max_restarts: int = typer.Option(0, "--max-restarts",
                                     help="Restart all ranks up to N times when one fails (torch elastic; a script "
                                          "resumes with cpdpkit.checkpoint.Checkpointer)."),
) -> None:
    """Launch SCRIPT [ARGS...] on --nproc-per-node ranks (torchrun), with an emulated network if asked.

    Example: cpdpkit launch --nproc-per-node 2 --topology wan --profile runs/ddp train.py --steps 20
    """
    from cpdpkit._outputs import check_output_dir
    from cpdpkit.launch import LaunchConfig, launch  # torch-free, but only this command needs it

    check_output_dir(profile, "--profile", inputs=(script,))
    check_output_dir(py_spy, "--py-spy", inputs=(script,))

    config = LaunchConfig(
        nproc_per_node=nproc_per_node, topology=topology, profile_dir=profile, py_spy_dir=py_spy,
        nnodes=nnodes, node_rank=node_rank, rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id, master_addr=master_addr, master_port=master_port, log_dir=log_dir,
        max_restarts=max_restarts,
    )
    result = launch(config, script, list(ctx.args))
    restarted = f"restarted {result.restarts} time(s)" if result.restarts else None
    if result.ok:
        extras = [restarted] if restarted else []
        if result.trace_files:
            extras.append(f"{len(result.trace_files)} trace file(s) in {profile}")
        if result.py_spy_files:
            extras.append(f"{len(result.py_spy_files)} py-spy profile(s) in {py_spy}")
        suffix = f"; {'; '.join(extras)}" if extras else ""
        out_console.print(f"[green]launch finished[/green] in {result.duration_s:.1f} s{escape(suffix)}",
                          soft_wrap=True)
        return
    after = f" (after {result.restarts} restart(s))" if result.restarts else ""
    err_console.print(f"[bold red]error:[/bold red] {escape(result.error or 'a rank failed')}{escape(after)}",
                      soft_wrap=True)
    for line in result.traceback_tail:
        err_console.print(f"  {escape(line)}", soft_wrap=True, highlight=False)
    err_console.print(f"  (rank logs: {escape(result.log_dir)})", soft_wrap=True, highlight=False)
    raise typer.Exit(1)
