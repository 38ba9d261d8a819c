"""What the user sees: a live progress line while running, a summary table at the end.

On a terminal the line is redrawn in place (rich Live); in logs (docker compose, CI) a plain
line is printed every few seconds instead, so the output stays readable.
"""

from __future__ import annotations

import asyncio
import contextlib

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from sim.simulation import SimReport, SimSnapshot, Simulation

LOG_INTERVAL = 5.0


def progress_text(snap: SimSnapshot, devices: int, subscribers: int) -> Text:
    text = Text()
    text.append(f"[{snap.phase} {snap.elapsed:6.1f}s] ", style="bold cyan")
    text.append(f"devices {snap.devices_online}/{devices}  ")
    text.append(f"subscribers {snap.subscribers_online}/{subscribers}  ")
    text.append(f"sent {snap.sent:,}  acked {snap.acknowledged:,}  ")
    text.append(f"received {snap.received:,}  expected {snap.expected:,}  ")
    # In flight while running; once the drain is over, what is still missing is lost.
    settled = snap.phase in ("closing", "done")
    label, bad = ("lost", "bold red") if settled else ("pending", "yellow")
    text.append(f"{label} {snap.outstanding:,}", style=bad if snap.outstanding else "green")
    if snap.failed:
        text.append(f"  failed {snap.failed:,}", style="red")
    if snap.foreign:
        text.append(f"  from other publishers {snap.foreign:,}")
    return text


async def follow(sim: Simulation, console: Console) -> None:
    """Show the progress of ``sim`` until cancelled."""
    devices, subscribers = sim.config.devices, sim.config.subscribers
    if console.is_terminal:
        with Live(console=console, refresh_per_second=4, transient=True) as live:
            try:
                while True:
                    live.update(progress_text(sim.snapshot(), devices, subscribers))
                    await asyncio.sleep(0.25)
            finally:
                with contextlib.suppress(Exception):
                    live.update(progress_text(sim.snapshot(), devices, subscribers))
    else:
        # Logs: a line when the phase changes and every LOG_INTERVAL seconds in between.
        phase, last = "", 0.0
        while True:
            snap = sim.snapshot()
            if snap.phase != phase or snap.elapsed - last >= LOG_INTERVAL:
                console.print(progress_text(snap, devices, subscribers), soft_wrap=True)
                phase, last = snap.phase, snap.elapsed
            await asyncio.sleep(0.1)


def summary(report: SimReport, width: int = 160) -> Table:
    """One row per subscriber; the filters column only when ``width`` leaves room for it."""
    table = Table(
        title=f"lmqtt sim run {report.run_id} (QoS {report.qos})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption="* persistent session that went offline and came back"
        if any(s.went_offline for s in report.subscribers)
        else None,
        caption_justify="left",
    )
    show_filters = width >= 120
    table.add_column("subscriber", no_wrap=True)
    table.add_column("session", no_wrap=True)
    if show_filters:
        table.add_column("filters", overflow="fold")
    numbers = ["expected", "received", "lost", "dup", "misrouted"]
    if report.foreign:
        numbers.append("other")
    for column in numbers:
        table.add_column(column, justify="right", no_wrap=True, min_width=len(column))
    for sub in report.subscribers:
        session = ("persistent" if sub.persistent else "clean") + ("*" if sub.went_offline else "")
        if sub.dropped:
            session += f" dropped x{sub.dropped}"
        row: list[str | Text] = [sub.name, session]
        if show_filters:
            row.append(" ".join(sub.filters))
        row += [
            f"{sub.expected:,}",
            f"{sub.received:,}",
            Text(f"{sub.lost:,}", style="bold red" if sub.lost else "green"),
            f"{sub.duplicates:,}",
            Text(f"{sub.misrouted:,}", style="bold red" if sub.misrouted else ""),
        ]
        if report.foreign:
            row.append(f"{sub.foreign:,}")
        table.add_row(*row)
    return table


def verdict(report: SimReport) -> Text:
    totals = (
        f"sent {report.sent:,}, acknowledged {report.acknowledged:,}, failed {report.failed:,}; "
        f"deliveries expected {report.expected:,}, received {report.received:,}, "
        f"lost {report.lost:,}, duplicates {report.duplicates:,} in {report.elapsed:.1f}s"
    )
    if report.foreign:
        totals += f"; {report.foreign:,} deliveries from other publishers (column 'other')"
    text = Text(totals + "\n")
    if report.ok:
        text.append(
            "OK: every acknowledged message reached every subscriber it was due to", "green"
        )
    else:
        problems = []
        if report.lost:
            problems.append(f"{report.lost:,} acknowledged deliveries never arrived")
        if report.misrouted:
            problems.append(f"{report.misrouted:,} deliveries did not match the filters")
        text.append("FAILED: " + "; ".join(problems), "bold red")
    if report.dropped:
        text.append(
            f"\n(the gateway dropped {report.dropped:,} subscriber connections; they reconnected"
            f" and resumed; {report.forgiven:,} deliveries pending in dropped clean sessions"
            " were not counted)",
            "yellow",
        )
    if report.failovers:
        text.append(
            f"\n({report.failovers:,} connects failed over to another gateway node)", "yellow"
        )
    if report.interrupted:
        text.append("\n(interrupted: publishing stopped early)", "yellow")
    if report.qos == 0:
        text.append("\n(QoS 0: nothing is acknowledged, so nothing can be judged lost)", "yellow")
    return text
